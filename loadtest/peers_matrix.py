"""Routers x workloads on a fleet of emulated workers: ``bench_peers --engine emulated``.

For each router a fresh fleet (private Redis, ``--workers`` emulated workers)
is started; each workload then runs on it in turn, after every worker's cache
is reset (``/reset_prefix_cache``, which also clears the gateways' index
through the ``AllBlocksCleared`` events). A peer router (sglang-router,
vllm-router) is started fresh for every workload; kvroute's gateways keep
running across workloads. Routers:

- ``kvroute``: the fleet's gateway; ``kvroute_3_replicas``: that gateway and
  two more on the same Redis, the client spreading requests round robin over
  the three; ``kvroute_round_robin``: the gateway with ``--policy round_robin``;
  ``kvroute_2_processes`` (only when asked for): the gateway with ``--processes 2``;
- ``sglang`` / ``vllm``: the peers with ``--policy cache_aware``.

Workloads: ``mooncake`` (the Mooncake conversation trace replayed by aiperf
with its timestamps, blocks rescaled to ``--trace-block-tokens``), ``chat``
(multi-turn chat with a shared system prompt), ``shared_prefix`` (RAG-like
groups with Zipf popularity) and ``bursty`` (those two mixed, every arrival
of each 20 s window squeezed into its first 4 s, as in the simulator's
sweep), played by kvroute's own client, which aiperf cannot do with real
answers fed back (chat) or Zipf groups.

Hit rate comes from the workers' own counters; TTFT and tokens/s from the
client. Times are reported in the emulated GPU's units (divided back by
``--emulated-time-scale``). The verdict and the markdown table are
``loadtest.peers_report``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import aiperf_client, stats
from loadtest.bench_fleet import FleetBenchConfig, fleet_config
from loadtest.client import ClientConfig, RequestResult, frozen_heap, send_one
from loadtest.fleet import Fleet, free_port
from loadtest.fleet_probe import (
    counters_delta,
    gateway_counters,
    gateway_figures,
    served_model,
    worker_counters,
    worker_ttft_mean,
    worker_ttft_totals,
)
from loadtest.fleet_summary import unscale
from loadtest.mooncake_trace import TRACE_ARRIVALS
from loadtest.peers_report import verdict
from loadtest.workloads import (
    ChatConfig,
    Conversation,
    SharedPrefixConfig,
    bursty,
    chat_workload,
    shared_prefix_workload,
)

logger = logging.getLogger(__name__)

ROUTERS = ("kvroute", "kvroute_3_replicas", "kvroute_round_robin", "sglang", "vllm")
WORKLOADS = ("mooncake", "chat", "shared_prefix", "bursty")
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class MatrixConfig:
    """Which workloads, and the shape of each."""

    workloads: tuple[str, ...] = WORKLOADS
    trace: str = "loadtest/traces/mooncake_conversation_trace.jsonl"
    trace_limit: int = 500
    trace_block_tokens: int = 32
    trace_speedup: float = 8.0
    trace_arrivals: str = "recorded"  # or "spread" (``rescale_trace``'s ``spread``)
    chat_users: int = 24
    chat_turns: int = 3
    chat_arrival_rate: float = 2.0
    prefix_groups: int = 12
    prefix_prompts: int = 16
    prefix_zipf: float = 1.1
    prefix_arrival_rate: float = 8.0
    aiperf_venv: str = ".venv-aiperf"
    rounds: int = 1

    def __post_init__(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise ValueError(f"--workloads {','.join(self.workloads)!r}: choose from {WORKLOADS}")
        if self.rounds < 1:
            raise ValueError(f"--rounds {self.rounds}: at least 1")
        if self.trace_arrivals not in TRACE_ARRIVALS:
            raise ValueError(f"--trace-arrivals {self.trace_arrivals!r}: one of {TRACE_ARRIVALS}")


def reset_caches(worker_urls: Sequence[str]) -> None:
    for url in worker_urls:
        req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


def start_replicas(fleet: Fleet, n: int) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """``n`` more kvroute gateways on the fleet's Redis; their base URLs and processes."""
    urls, procs = [], []
    for i in range(n):
        port = free_port()
        args = [
            "gateway",
            "--model",
            fleet.model_dir,
            "--redis-url",
            fleet.redis_url,
            "--redis-namespace",
            fleet.config.namespace,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            fleet.config.policy,
        ]
        proc = fleet._spawn(f"gateway-{i + 2}", args)
        procs.append(proc)
        _wait_ready(f"http://127.0.0.1:{port}", len(fleet.workers), proc)
        urls.append(f"http://127.0.0.1:{port}")
    return urls, procs


def _wait_ready(
    url: str, workers: int, proc: subprocess.Popen[bytes], timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway replica exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if json.loads(resp.read()).get("healthy_workers", 0) >= workers:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"gateway replica {url} not ready within {timeout:.0f}s")


async def play_spread(
    convs: Sequence[Conversation], clients: Sequence[ClientConfig]
) -> list[RequestResult]:
    """Open-loop play of ``convs``; each request goes to the next of ``clients`` (round robin)."""
    rotation = itertools.cycle(clients)
    scale = clients[0].time_scale
    out: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=clients[0].request_timeout_s)

    async def conversation(session: aiohttp.ClientSession, conv: Conversation, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + conv.start_s * scale - time.perf_counter()))
        answers: list[str] = []
        for k, turn in enumerate(conv.turns):
            if k:
                await asyncio.sleep(turn.think_s * scale)
            res = await send_one(session, next(rotation), conv, k, answers, t0)
            out.append(res)
            if not res.ok:
                return
            answers.append(res.text)

    with frozen_heap():
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.perf_counter()
            await asyncio.gather(*(conversation(session, c, t0) for c in convs))
    return out


def client_figures(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = stats.latency_summary([r.ttft_s for r in ok if r.ttft_s is not None])
    start = min((r.sent_s for r in results), default=0.0)
    end = max((r.sent_s + (r.e2e_s or 0.0) for r in ok), default=0.0)
    return {
        "ttft_p50_s": ttft["p50"],
        "ttft_p95_s": stats.percentile([r.ttft_s for r in ok if r.ttft_s is not None], 95),
        "ttft_p99_s": ttft["p99"],
        "ttft_mean_s": ttft["mean"],
        "tokens_per_s": stats.throughput(sum(r.completion_tokens for r in ok), start, end),
        "requests": len(results),
        "errors": len(results) - len(ok),
        "client": "kvroute loadtest.client",
    }


def synthetic(name: str, mcfg: MatrixConfig, seed: int) -> list[Conversation]:
    if name == "bursty":  # as the simulator's sweep mixes them (``loadtest.sweep``)
        mixed = [*synthetic("chat", mcfg, seed), *synthetic("shared_prefix", mcfg, seed + 1)]
        return bursty(mixed)
    if name == "chat":
        return chat_workload(
            ChatConfig(
                users=mcfg.chat_users,
                turns=mcfg.chat_turns,
                system_tokens=500,
                question_tokens=50,
                answer_tokens=48,
                think_time_s=2.0,
                arrival_rate=mcfg.chat_arrival_rate,
                seed=seed,
            )
        )
    return shared_prefix_workload(
        SharedPrefixConfig(
            groups=mcfg.prefix_groups,
            prompts_per_group=mcfg.prefix_prompts,
            system_tokens=2000,
            question_tokens=64,
            output_tokens=24,
            arrival_rate=mcfg.prefix_arrival_rate,
            seed=seed,
            zipf=mcfg.prefix_zipf,
        )
    )


def run_workload(
    cfg: FleetBenchConfig,
    mcfg: MatrixConfig,
    workload: str,
    urls: Sequence[str],
    worker_urls: Sequence[str],
    model_dir: str,
    work: Path,
) -> dict[str, Any]:
    """One workload through ``urls`` (one router, or kvroute replicas); worker-counter hit rate."""
    scale = cfg.emulated_time_scale
    model = served_model(worker_urls[0])
    reset_caches(worker_urls)
    before = worker_counters(worker_urls)
    ttft_before = worker_ttft_totals(worker_urls)
    gateways = workload_gateways(urls, worker_urls)
    gateways_before = gateway_counters(gateways) if gateways else {}
    if workload == "mooncake":
        binary = aiperf_client.ensure_aiperf(mcfg.aiperf_venv)
        cache = work / "hub"
        tokenizer = aiperf_client.hub_cache(model_dir, cache)
        trace = work / "mooncake-rescaled.jsonl"
        shape = aiperf_client.rescale_trace(
            ROOT / mcfg.trace,
            trace,
            block_tokens=mcfg.trace_block_tokens,
            limit=mcfg.trace_limit,
            time_scale=scale,
            speedup=mcfg.trace_speedup,
            spread=mcfg.trace_arrivals == "spread",
        )
        artifacts = work / f"aiperf-{len(list(work.glob('aiperf-*')))}"
        cmd = aiperf_client.aiperf_command(
            binary,
            model=model,
            tokenizer=tokenizer,
            urls=urls,
            trace=trace,
            block_tokens=mcfg.trace_block_tokens,
            artifact_dir=artifacts,
        )
        timeout = 600 + shape["span_s"] * scale * 3
        out = aiperf_client.run_aiperf(cmd, cache, artifacts, time_scale=scale, timeout_s=timeout)
        out["trace"] = shape
    else:
        clients = [
            ClientConfig(base_url=u, model=model, ignore_eos=True, time_scale=scale) for u in urls
        ]
        convs = synthetic(workload, mcfg, cfg.seed)
        out = client_figures(unscale(asyncio.run(play_spread(convs, clients)), scale))
    delta = counters_delta(before, worker_counters(worker_urls))
    out["hit_rate"] = delta["hit_rate"]
    out["max_worker_share"] = max(delta["prompt_share"].values(), default=float("nan"))
    out["prompt_tokens"] = delta["prompt_tokens"]
    # The engines' own TTFT beside the client's: the difference is what the path in
    # front of the engine adds (router, HTTP or gRPC, tokenizing), whichever router it is.
    out["worker_ttft_mean_s"] = worker_ttft_mean(
        ttft_before, worker_ttft_totals(worker_urls), scale
    )
    out["front_ttft_mean_s"] = out["ttft_mean_s"] - out["worker_ttft_mean_s"]
    if gateways:
        # The index's predictions beside the workers' counts: a gap is the index's error
        # (stale or speculative entries), a low prediction the routing's choices.
        out["gateway"] = gateway_figures(gateways_before, gateway_counters(gateways), scale)
    return out


def workload_gateways(urls: Sequence[str], worker_urls: Sequence[str]) -> list[str]:
    """The kvroute gateways among ``urls`` (a peer router's URL is not one)."""
    out = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
                if b"kvroute_gateway_" in resp.read():
                    out.append(url)
        except OSError:
            pass
    return [u for u in out if u not in worker_urls]


def run_router(
    cfg: FleetBenchConfig, pcfg: Any, mcfg: MatrixConfig, router: str
) -> dict[str, dict[str, Any]]:
    """A fresh emulated fleet for ``router``; every workload on it, in order."""
    from loadtest import bench_peers

    policy = "round_robin" if router == "kvroute_round_robin" else "kvroute"
    out: dict[str, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix=f"kvroute-matrix-{router}-"))
    # Sixteen workers on a loaded 2-core host can take minutes to register.
    fleet_cfg = replace(fleet_config(cfg, policy, router), startup_timeout=900.0)
    if router == "kvroute_2_processes":
        fleet_cfg = replace(fleet_cfg, gateway_args=(*fleet_cfg.gateway_args, "--processes", "2"))
    with Fleet(fleet_cfg) as fleet:
        worker_urls = [w.http_url for w in fleet.workers]
        urls = [fleet.gateway_url]
        extra: list[subprocess.Popen[bytes]] = []
        try:
            if router == "kvroute_3_replicas":
                more, extra = start_replicas(fleet, 2)
                urls += more
            for workload in mcfg.workloads:
                started = time.perf_counter()
                try:
                    if router in ("sglang", "vllm"):
                        out[workload] = bench_peers.with_peer(
                            cfg,
                            pcfg,
                            router,
                            fleet,
                            work,
                            lambda url, w=workload: run_workload(
                                cfg, mcfg, w, [url], worker_urls, fleet.model_dir, work
                            ),
                        )
                    else:
                        out[workload] = run_workload(
                            cfg, mcfg, workload, urls, worker_urls, fleet.model_dir, work
                        )
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    logger.warning("%s on %s failed: %s", router, workload, exc)
                    out[workload] = {"error": f"{type(exc).__name__}: {exc}"}
                out[workload]["wall_s"] = time.perf_counter() - started
        finally:
            for proc in extra:
                proc.terminate()
                proc.wait(timeout=15)
    return out


def run(cfg: FleetBenchConfig, pcfg: Any, mcfg: MatrixConfig, command: str) -> dict[str, Any]:
    """Every router (fresh fleet each) x every workload, ``rounds`` times; the issue's JSON shape.

    Rounds alternate the routers' order, so a host growing slower or quicker
    during the run weighs on every router alike; each figure is then the
    median over the rounds (one run's TTFT p99 moves ~15 % from run to run).
    """
    rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
    for k in range(mcfg.rounds):
        order = list(pcfg.routers) if k % 2 == 0 else list(reversed(pcfg.routers))
        by_router: dict[str, dict[str, dict[str, Any]]] = {}
        for router in order:
            logger.warning(
                "round %d/%d, router %s: starting a fresh fleet of %d workers",
                k + 1,
                mcfg.rounds,
                router,
                cfg.workers,
            )
            try:
                by_router[router] = run_router(cfg, pcfg, mcfg, router)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                logger.warning("router %s: the fleet failed: %s", router, exc)
                by_router[router] = {
                    w: {"error": f"{type(exc).__name__}: {exc}"} for w in mcfg.workloads
                }
            if cfg.log_dir:  # a long run keeps what it measured so far
                partial = Path(cfg.log_dir) / "partial.json"
                partial.write_text(json.dumps([*rounds, by_router], default=str))
        rounds.append(by_router)
    by_router = {
        router: {w: median_round([r[router][w] for r in rounds]) for w in mcfg.workloads}
        for router in pcfg.routers
    }
    keys = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "max_worker_share")
    workloads: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in mcfg.workloads:
        workloads[workload] = {}
        for router, rows in by_router.items():
            r = rows.get(workload, {})
            workloads[workload][router] = (
                {k: r[k] for k in (*keys, "gateway") if k in r}
                if "hit_rate" in r
                else {"error": r.get("error", "?")}
            )
    return {
        "workloads": workloads,
        "command": command,
        "load_average": os.getloadavg(),
        **verdict(workloads),
        "config": {
            "fleet": {
                "workers": cfg.workers,
                "engine": cfg.engine,
                "profile": cfg.profile,
                "emulated_time_scale": cfg.emulated_time_scale,
                "num_blocks": cfg.num_blocks,
                "max_num_seqs": cfg.max_num_seqs,
            },
            "matrix": {k: v for k, v in vars(mcfg).items()},
        },
        "details": by_router,
    }


def median_round(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One router's figures on one workload over rounds: each number its median.

    Rounds that failed are left out (an error is reported only when all did);
    the rounds themselves are kept under ``rounds``.
    """
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if "hit_rate" in r]
    if not ok:
        return {"error": runs[0].get("error", "?"), "rounds": list(runs)}
    return {**medians(ok), "rounds": list(runs)}


def medians(figures: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per key of the first dict, the median of the numbers (nested dicts likewise)."""
    out: dict[str, Any] = {}
    for key in figures[0]:
        values: list[Any] = [f.get(key) for f in figures]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        elif all(isinstance(v, dict) for v in values):
            out[key] = medians(values)
    return out


def matrix_config(args: Any) -> MatrixConfig:
    d = MatrixConfig()
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    return replace(
        d,
        workloads=workloads,
        trace_limit=args.trace_limit,
        trace_block_tokens=args.trace_block_tokens,
        trace_speedup=args.trace_speedup,
        trace_arrivals=args.trace_arrivals,
        rounds=args.rounds,
    )
