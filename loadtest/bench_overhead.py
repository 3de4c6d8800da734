"""Router overhead side by side: kvroute's gateway vs sglang-router and vllm-router.

Every router fronts the same *instant* fake workers (no inference: tokens come
back at once), so what is measured is the router: CPU per request (the router
process's user + system CPU over the round / requests served), latency at
c=64 and at c=1, and the most requests per second it sustained. kvroute talks
gRPC to its fakes (registered in a private Redis with the real publisher);
the peers talk OpenAI HTTP to theirs. The peers are the Rust binaries from PyPI
(``loadtest.bench_peers.ensure_peer_venv``), in ``round_robin`` and
``cache_aware``. ``kvroute`` carries its requests on each fake's frames port
(``contract.frames``, as with workers started with ``--frames-port``);
``kvroute_grpc`` is the same gateway with ``--worker-frames false`` (the
worker's one gRPC ``GenerateMany`` stream) and ``kvroute_generate`` with
``--grpc-mux false`` too (one ``Generate`` call per request);
``kvroute_cpu_vs_grpc`` and ``kvroute_cpu_vs_generate`` are the ratios of
their CPU per request. ``kvroute_http`` is the gateway in front of the same
fakes as vLLM workers (``openai-http`` records: streamed ``/v1/completions``
with token ids, one SSE event per token and the prompt's ids echoed first,
as vLLM 0.32 sends them), the transport of a vLLM fleet;
``kvroute_cpu_vs_http`` is that ratio. ``kvroute_2proc`` is ``kvroute`` with ``--processes 2``
(two processes on one port, one block index; CPU counts both);
``kvroute_2proc_rps_vs_1`` is its ``chat_small`` throughput over ``kvroute``'s.
``kvroute_baseline`` is ``kvroute`` run from another checkout
(``--baseline-tree``: a ``git worktree`` of an earlier commit), so a change is
measured against the build before it in the same run, round by round;
``kvroute_cpu_vs_baseline`` is the ratio (``kvroute_http_baseline`` and
``kvroute_http_cpu_vs_baseline`` the same in front of the vLLM-shaped fakes).
``aiohttp_floor`` (``loadtest.aiohttp_floor``) is aiohttp on uvloop answering at
once and routing nothing: the floor under any router built on it, and
``kvroute_cpu_vs_aiohttp_floor`` how far above it kvroute is; ``aiohttp_proxy`` is
the same server as a round-robin proxy to the fakes (the peers' ``round_robin``
in Python), and ``kvroute_cpu_vs_aiohttp_proxy`` that ratio. Rounds interleave the routers (A/B/A/B), and every figure is
the median over rounds. The peers do not tokenize; kvroute does. The fakes
are ``loadtest.instant_workers``: one message (gRPC) or SSE event (HTTP) per
token, as a worker sends them when it keeps up, and kvroute's publish the
blocks of the prompts they served (``FakeCache``), as workers do; ``--stream-interval N`` makes
them send every N tokens, as workers started with that flag do.

Workloads: ``chat_small`` (a ~209-token chat, 8 tokens out), ``stream_128``
(the same chat streamed, 128 tokens, one worker message per token),
``chat_6k_repeat`` (one ~6k-token 12-turn chat sent again and again) and
``chat_6k_cold`` (a different ~6k-token chat every request: 200 chats, each
sent with a number never sent before at the start of its system prompt, so
no prefix of it was seen by any cache); ``json_256``, only when named, is the
small chat answered with 256 tokens as one JSON body (where ``--concurrency``
below 16 shows the worker messages a whole answer saves).

    python -m loadtest.bench_overhead                         # ~10 min
    python -m loadtest.bench_overhead --routers kvroute --seconds 3 --rounds 1
    python -m loadtest.bench_overhead --routers kvroute --stream-interval 4
    python -m loadtest.bench_overhead --routers kvroute --workloads json_256 --concurrency 4
    git worktree add /tmp/kvroute-base HEAD~3 && python -m loadtest.bench_overhead \
        --routers kvroute,kvroute_baseline --baseline-tree /tmp/kvroute-base --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from loadtest.bench_peers import PeersConfig, ensure_peer_venv
from loadtest.fleet import free_port, sigterm_as_ctrl_c
from loadtest.instant_workers import MODEL, http_namespace
from loadtest.scale_redis import PrivateRedis
from loadtest.words import WORDS

ROOT = Path(__file__).resolve().parents[1]
ROUTERS = (
    "kvroute",
    "kvroute_http",
    "kvroute_2proc",
    "kvroute_grpc",
    "kvroute_generate",
    "kvroute_baseline",
    "kvroute_http_baseline",
    "sglang_rr",
    "sglang_cache_aware",
    "vllm_rr",
    "vllm_cache_aware",
    "aiohttp_floor",
    "aiohttp_proxy",
)
WORKLOADS = ("chat_small", "stream_128", "chat_6k_repeat", "chat_6k_cold")
# Run only when named (``--workloads``): not part of the table.
EXTRA_WORKLOADS = ("json_256",)
NAMESPACE = "overhead"  # the fakes' Redis namespace
NONCE = b"@nonce@"  # in a cold body's system prompt; see _sendable
_SENT = itertools.count(1)


# -- workloads -----------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _chat(rng: random.Random, turns: int, words: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": _words(rng, 40)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": _words(rng, words)})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": _words(rng, words)})
    return msgs


def make_bodies(workload: str, count: int, seed: int) -> list[bytes]:
    """Request bodies for ``workload`` (one for the repeated ones)."""
    rng = random.Random(seed)
    small = _chat(rng, 1, 130)  # ~209 tokens with the template
    if workload == "chat_small":
        return [json.dumps({"model": MODEL, "messages": small, "max_tokens": 8}).encode()]
    if workload == "stream_128":
        body = {"model": MODEL, "messages": small, "max_tokens": 128, "stream": True}
        return [json.dumps(body).encode()]
    if workload == "json_256":
        return [json.dumps({"model": MODEL, "messages": small, "max_tokens": 256}).encode()]
    long = _chat(rng, 12, 210)  # ~6k tokens over 12 turns
    if workload == "chat_6k_repeat":
        return [json.dumps({"model": MODEL, "messages": long, "max_tokens": 8}).encode()]
    bodies = []
    for _ in range(count):
        chat = _chat(rng, 12, 210)
        chat[0]["content"] = NONCE.decode() + " " + chat[0]["content"]
        bodies.append(json.dumps({"model": MODEL, "messages": chat, "max_tokens": 8}).encode())
    return bodies


def _sendable(body: bytes) -> bytes:
    """``body`` as sent: a cold body's marker replaced by a number this run never sent."""
    return body.replace(NONCE, b"%d" % next(_SENT)) if NONCE in body else body


async def _load(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict[str, Any]:
    """Closed loop at ``concurrency`` for ``seconds``: latencies and how many succeeded."""
    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds
    cursor = 0
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def user() -> None:
            nonlocal cursor, errors
            while time.perf_counter() < stop:
                body = _sendable(bodies[cursor % len(bodies)])
                cursor += 1
                t0 = time.perf_counter()
                try:
                    async with http.post(
                        url + "/v1/chat/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append((time.perf_counter() - t0) * 1e3)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"latencies_ms": lat, "errors": errors, "elapsed_s": elapsed}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- routers -------------------------------------------------------------------------


def _ready(router: Router) -> bool:
    with (
        contextlib.suppress(urllib.error.URLError),
        urllib.request.urlopen(router.url + "/readyz", timeout=2) as resp,
    ):
        return bool(resp.status == 200)
    return False


class Router:
    """One router process: kvroute's gateway or a peer binary."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, tree: Path = ROOT) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("wb")
        # Another checkout's gateway: its own packages first (``-m`` puts the cwd first).
        env = None if tree == ROOT else {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=tree, env=env
        )
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        total = 0.0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def wait_ready(self, body: bytes, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._log.flush()
                tail = Path(self._log.name).read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {tail}")
            try:
                out = asyncio.run(_load(self.url, [body], 1, 0.01))
                # kvroute's /readyz also waits for a multi-process gateway's every process:
                # a connection made before they all listen stays on the first one.
                if out["latencies_ms"] and (not self.name.startswith("kvroute") or _ready(self)):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} never answered a request")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _router_cmd(name: str, port: int, redis_url: str, ns: str, urls: list[str]) -> list[str]:
    name = name.removesuffix("_baseline")  # the same gateway, from --baseline-tree
    if name.startswith("kvroute"):
        if name == "kvroute_http":  # the same fakes as vLLM workers: OpenAI HTTP, no gRPC
            ns = http_namespace(ns)
        return [
            *(sys.executable, "-m", "kvroute_cli", "gateway", "--model", "smollm2"),
            *("--served-model-name", MODEL, "--redis-url", redis_url, "--redis-namespace", ns),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
            # kvroute_grpc: the workers' gRPC stream instead of their frames port;
            # kvroute_generate: one Generate call per request.
            *(
                "--worker-frames",
                "false" if name in ("kvroute_grpc", "kvroute_generate") else "true",
            ),
            *("--grpc-mux", "false" if name == "kvroute_generate" else "true"),
            # The kvroute variants are separate routers that share the fakes' namespace,
            # not replicas of one deployment: synced as replicas, each published every
            # request to the others (c=1 p50 0.78 against 0.49 ms alone). kvroute_2proc
            # is one gateway of two processes, which share load as replicas do.
            *("--replica-sync", "true" if name == "kvroute_2proc" else "false"),
            *("--processes", "2" if name == "kvroute_2proc" else "1"),
        ]
    if name.startswith("aiohttp_"):  # aiohttp alone, routing nothing: floors under kvroute
        forward = ("--forward", ",".join(urls)) if name == "aiohttp_proxy" else ()
        return [sys.executable, "-m", "loadtest.aiohttp_floor", "--port", str(port), *forward]
    bin_dir = ensure_peer_venv(PeersConfig())
    policy = "round_robin" if name.endswith("_rr") else "cache_aware"
    # Every router runs at once (rounds interleave), so each gets its own metrics port.
    metrics = ("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()))
    if name.startswith("sglang"):
        return [
            *(str(bin_dir / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)),
            *("--worker-urls", *urls, "--policy", policy, "--log-level", "warn", *metrics),
        ]
    return [
        *(str(bin_dir / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)),
        *("--worker-urls", *urls, "--policy", policy, "--log-level", "warning", *metrics),
    ]


def measure(
    router: Router, workload: str, bodies: list[bytes], seconds: float, concurrency: int = 64
) -> dict[str, Any]:
    """One round of ``workload`` on ``router``: throughput and CPU at ``concurrency``
    (c=64 unless told), then c=1 latency."""
    cpu0 = router.cpu_s()
    hot = asyncio.run(_load(router.url, bodies, concurrency, seconds))
    cpu = router.cpu_s() - cpu0
    n = len(hot["latencies_ms"])
    c1 = asyncio.run(_load(router.url, bodies, 1, min(2.0, seconds)))
    return {
        "cpu_ms_per_request": cpu * 1e3 / max(1, n),
        "max_rps": n / hot["elapsed_s"],
        "p50_ms": _pct(hot["latencies_ms"], 0.5),
        "p99_ms": _pct(hot["latencies_ms"], 0.99),
        "p50_ms_c1": _pct(c1["latencies_ms"], 0.5),
        # Cores the router kept busy at that concurrency (above 1: it used more than one).
        "cores_used": cpu / hot["elapsed_s"],
        "errors": hot["errors"] + c1["errors"],
    }


def start_fakes(
    workers: int, redis_url: str, ns: str, ready: Path, stream_interval: int = 1
) -> subprocess.Popen[bytes]:
    """``loadtest.instant_workers`` in a process of their own; ``wait_fakes`` for their URLs."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import asyncio; from pathlib import Path; "
            "from loadtest.instant_workers import serve_instant_workers; "
            f"asyncio.run(serve_instant_workers({workers}, {redis_url!r}, {ns!r}, "
            f"Path({str(ready)!r}), {stream_interval}))",
        ],
        cwd=ROOT,
    )


def wait_fakes(fakes: subprocess.Popen[bytes], ready: Path) -> list[str]:
    """The fakes' HTTP URLs once every one is registered."""
    deadline = time.monotonic() + 60
    while not ready.exists():
        if time.monotonic() > deadline or fakes.poll() is not None:
            raise RuntimeError("fake workers did not start")
        time.sleep(0.1)
    return list(json.loads(ready.read_text()))


def run(
    routers: list[str],
    workloads: list[str],
    rounds: int,
    seconds: float,
    workers: int,
    stream_interval: int = 1,
    baseline_tree: Path | None = None,
    concurrency: int = 64,
) -> Any:
    if any(r.endswith("_baseline") for r in routers) and baseline_tree is None:
        raise ValueError("a *_baseline router needs --baseline-tree")
    started: dict[str, Router] = {}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {r: {} for r in routers}
    skipped: dict[str, str] = {}
    with fake_fleet(workers, stream_interval) as fleet:
        try:
            bodies = {w: make_bodies(w, 200, seed=i) for i, w in enumerate(workloads)}
            for name in routers:
                try:
                    tree = baseline_tree if name.endswith("_baseline") and baseline_tree else ROOT
                    router = fleet.router(name, tree)
                    router.wait_ready(bodies[workloads[0]][0])
                    started[name] = router
                except Exception as exc:  # a peer that cannot run is reported, the rest go on
                    skipped[name] = f"{type(exc).__name__}: {exc}"
            # The direct p50 that "added" latency subtracts is measured in every round,
            # with every router up, as the routers' own c=1 latency is: measured once on a
            # quiet host before they started, it made each router's added p50 look larger.
            directs: dict[str, list[float]] = {w: [] for w in workloads}
            for _ in range(rounds):
                for w in workloads:
                    directs[w].append(_direct_p50(fleet.urls[0], bodies[w]))
                    for name, router in started.items():
                        results[name].setdefault(w, []).append(
                            measure(router, w, bodies[w], seconds, concurrency)
                        )
            direct = {w: statistics.median(v) for w, v in directs.items()}
            summary = summarize(results, started, skipped, direct, workloads)
            return {**summary, "stream_interval": stream_interval, "concurrency": concurrency}
        finally:
            for router in started.values():
                router.close()


@dataclass
class FakeFleet:
    """``start_fakes``' workers, registered in a private Redis, and a folder for logs."""

    redis_url: str
    urls: list[str]  # the fakes' OpenAI HTTP fronts
    tmp: Path

    def router(self, name: str, tree: Path = ROOT) -> Router:
        """Router ``name`` started in front of these fakes (not yet ready)."""
        port = free_port()
        cmd = _router_cmd(name, port, self.redis_url, NAMESPACE, self.urls)
        return Router(name, cmd, port, self.tmp / f"{name}.log", tree)


@contextlib.contextmanager
def fake_fleet(workers: int, stream_interval: int = 1) -> Iterator[FakeFleet]:
    """A private Redis, ``workers`` instant fakes registered in it, and a temporary
    folder; all gone afterwards."""
    redis = PrivateRedis()
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-overhead-"))
    fakes = start_fakes(workers, redis.url, NAMESPACE, tmp / "ready.json", stream_interval)
    try:
        yield FakeFleet(redis.url, wait_fakes(fakes, tmp / "ready.json"), tmp)
    finally:
        fakes.terminate()
        fakes.wait(10)
        redis.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _direct_p50(url: str, bodies: list[bytes]) -> float:
    """p50 at c=1 straight to a fake HTTP worker: what 'added' latency is measured against."""
    out = asyncio.run(_load(url, bodies, 1, 1.0))
    return _pct(out["latencies_ms"], 0.5)


def summarize(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    started: dict[str, Router],
    skipped: dict[str, str],
    direct: dict[str, float],
    workloads: list[str],
) -> dict[str, Any]:
    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out: dict[str, Any] = {}
    for name in started:
        per: dict[str, Any] = {}
        for w in workloads:
            rows = results[name][w]
            per[w] = {
                "cpu_ms_per_request": round(med(rows, "cpu_ms_per_request"), 3),
                "max_rps": round(med(rows, "max_rps"), 1),
                "p50_ms": round(med(rows, "p50_ms"), 2),
                "p99_ms": round(med(rows, "p99_ms"), 2),
                "added_p50_ms_c1": round(med(rows, "p50_ms_c1") - direct[w], 3),
                "cores_used": round(med(rows, "cores_used"), 2),
                "errors": sum(r["errors"] for r in rows),
            }
        if "stream_128" in per and "chat_small" in per:
            extra = (
                per["stream_128"]["cpu_ms_per_request"] - per["chat_small"]["cpu_ms_per_request"]
            )
            per["cpu_ms_per_streamed_token"] = round(max(0.0, extra) / 120, 4)
        out[name] = per
    base = out.get("sglang_rr")
    for per in out.values():
        for w in workloads:
            if base is not None and base[w]["max_rps"]:
                per[w]["rps_vs_sglang_rr"] = round(per[w]["max_rps"] / base[w]["max_rps"], 3)
            else:
                per[w]["rps_vs_sglang_rr"] = None
    kv = out.get("kvroute", {})

    def cpu_ratio(other: dict[str, Any], this: dict[str, Any] = kv) -> dict[str, float]:
        """``this`` router's (kvroute's) CPU per request over ``other``'s, per workload."""
        return {
            w: round(this[w]["cpu_ms_per_request"] / other[w]["cpu_ms_per_request"], 3)
            for w in workloads
            if w in this and w in other and other[w]["cpu_ms_per_request"]
        }

    targets = {
        "chat_small_cpu_ms_per_request <= 0.5": kv.get("chat_small", {}).get("cpu_ms_per_request"),
        "chat_6k_repeat_cpu_ms_per_request <= 1.0": kv.get("chat_6k_repeat", {}).get(
            "cpu_ms_per_request"
        ),
        "chat_6k_cold_cpu_ms_per_request <= 5": kv.get("chat_6k_cold", {}).get(
            "cpu_ms_per_request"
        ),
        "cpu_ms_per_streamed_token <= 0.02": kv.get("cpu_ms_per_streamed_token"),
        "chat_small_rps_vs_sglang_rr >= 0.25": kv.get("chat_small", {}).get("rps_vs_sglang_rr"),
        "chat_small_added_p50_ms_c1 <= 0.5": kv.get("chat_small", {}).get("added_p50_ms_c1"),
    }
    # A target whose workload this run left out is null, not false: it was not measured.
    met: dict[str, bool | None] = {}
    for key, value in targets.items():
        op, bound = key.split()[-2], float(key.split()[-1])
        met[key] = None if value is None else (value <= bound if op == "<=" else value >= bound)
    return {
        "benchmark": "router overhead on instant fake workers (no inference)",
        "routers": out,
        "skipped": skipped,
        # The transport's share, measured in the same run: the frames port over the gRPC
        # stream, and over one Generate call per request.
        "kvroute_cpu_vs_grpc": cpu_ratio(out.get("kvroute_grpc", {})),
        # Frames to kvroute workers over OpenAI HTTP to vLLM-shaped ones, same run.
        "kvroute_cpu_vs_http": cpu_ratio(out.get("kvroute_http", {})),
        "kvroute_cpu_vs_generate": cpu_ratio(out.get("kvroute_generate", {})),
        # Over an aiohttp server that answers at once and routes nothing, same run.
        "kvroute_cpu_vs_aiohttp_floor": cpu_ratio(out.get("aiohttp_floor", {})),
        # Over a round-robin proxy in Python (aiohttp + kvroute's HTTP client), same run.
        "kvroute_cpu_vs_aiohttp_proxy": cpu_ratio(out.get("aiohttp_proxy", {})),
        # This checkout against --baseline-tree's, same run.
        "kvroute_cpu_vs_baseline": cpu_ratio(out.get("kvroute_baseline", {})),
        "kvroute_http_cpu_vs_baseline": cpu_ratio(
            out.get("kvroute_http_baseline", {}), out.get("kvroute_http", {})
        ),
        # Two processes on one port against one, same run: what a second core buys.
        "kvroute_2proc_rps_vs_1": _ratio(
            out.get("kvroute_2proc", {}).get("chat_small", {}).get("max_rps"),
            kv.get("chat_small", {}).get("max_rps"),
        ),
        "direct_p50_ms_c1": {w: round(v, 3) for w, v in direct.items()},
        "targets_met": met,
        "target_met": all(v is True for v in met.values()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--routers", default=",".join(r for r in ROUTERS if not r.endswith("_baseline"))
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0, help="per workload and round")
    parser.add_argument("--workers", type=int, default=2, help="fake workers behind each router")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="clients for the throughput and CPU figures"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per worker message after the first (a worker's --stream-interval)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="another kvroute checkout (e.g. a git worktree of an earlier commit) that "
        "the *_baseline routers run from",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.stream_interval < 1:
        raise SystemExit(f"--stream-interval {args.stream_interval}: must be at least 1")
    routers = [r for r in args.routers.split(",") if r]
    for r in routers:
        if r not in ROUTERS:
            raise SystemExit(f"--routers: {r!r} is not one of {', '.join(ROUTERS)}")
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS + EXTRA_WORKLOADS:
            known = ", ".join(WORKLOADS + EXTRA_WORKLOADS)
            raise SystemExit(f"--workloads: {w!r} is not one of {known}")
    if args.concurrency < 1:
        raise SystemExit(f"--concurrency {args.concurrency}: must be at least 1")
    if any(r.endswith("_baseline") for r in routers) != (args.baseline_tree is not None):
        raise SystemExit("--baseline-tree and a *_baseline router go together")
    if args.baseline_tree is not None and not (args.baseline_tree / "kvroute_cli.py").is_file():
        raise SystemExit(f"--baseline-tree {args.baseline_tree}: not a kvroute checkout")
    with sigterm_as_ctrl_c():
        result = run(
            routers,
            workloads,
            args.rounds,
            args.seconds,
            args.workers,
            args.stream_interval,
            args.baseline_tree.resolve() if args.baseline_tree else None,
            args.concurrency,
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
