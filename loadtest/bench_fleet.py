"""Real-fleet benchmark: the multi-turn chat workload through a live gateway, per routing policy.

For each policy in ``--policies`` a fresh ``Fleet`` is started (private Redis,
``--workers`` worker processes, a gateway with that policy), each worker is
warmed up once directly on its HTTP front with an unrelated prompt, and the
seeded chat workload is played open loop with concurrent users. One JSON object
goes to stdout: per policy and per turn (1-based) the token hit rate (cached
prompt tokens / prompt tokens, from the usage the gateway returns), mean and
p50 TTFT, plus overall numbers, the routing reasons the gateway reported, and
the workers' own ``/metrics`` hit rate as a cross-check. ``acceptance`` compares
the policies over turns >= ``--from-turn``. ``--plot`` draws hit rate and TTFT
per turn, one line per policy.

Usage: ``python -m loadtest.bench_fleet --workers 2 --policies kvroute,round_robin
[--users 6 --turns 4 --model smollm2 --plot docs/bench_fleet.png --json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import aiohttp

from loadtest import stats
from loadtest.client import ClientConfig, RequestResult, send_one
from loadtest.fleet import Fleet, FleetConfig
from loadtest.workloads import ChatConfig, Conversation, chat_workload

logger = logging.getLogger(__name__)

REASON_HEADER = "x-kvroute-reason"
ENGINES = ("torch", "emulated", "vllm")  # vllm: real vLLM CPU servers behind bridges
# The GPU profile the README's fleet-scale figures use (worker/model/profiles/).
DEFAULT_PROFILE = "h100-llama3.1-8b"
_COUNTER_RE = re.compile(
    r"^(kvroute_worker_(?:cached_)?prompt_tokens_total|vllm:prompt_tokens(?:_cached)?_total)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)$",
    re.M,
)


@dataclass(frozen=True)
class FleetBenchConfig:
    """Fleet shape, workload shape and what to compare."""

    model: str = "smollm2"
    workers: int = 2
    policies: tuple[str, ...] = ("kvroute", "round_robin")
    users: int = 6
    turns: int = 4
    system_tokens: int = 500
    question_tokens: int = 50
    answer_tokens: int = 200
    think_time_s: float = 1.0
    arrival_rate: float = 1.0
    seed: int = 0
    num_blocks: int = 2048
    max_num_seqs: int = 16
    worker_threads: int = 1  # torch threads per worker; 0 = torch's default
    from_turn: int = 3
    log_dir: str = ""
    engine: str = "torch"  # "emulated": workers run a profile's time model (see below)
    profile: str = DEFAULT_PROFILE
    emulated_time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: choose from {', '.join(ENGINES)}")
        if not self.policies:
            raise ValueError("--policies must name at least one policy")
        if self.worker_threads < 0:
            raise ValueError("--worker-threads must be >= 0")
        if not 1 <= self.from_turn <= self.turns:
            raise ValueError(f"--from-turn must be in [1, --turns={self.turns}]")

    def chat(self) -> ChatConfig:
        return ChatConfig(
            users=self.users,
            turns=self.turns,
            system_tokens=self.system_tokens,
            question_tokens=self.question_tokens,
            answer_tokens=self.answer_tokens,
            think_time_s=self.think_time_s,
            arrival_rate=self.arrival_rate,
            seed=self.seed,
        )


# -- talking to the fleet -------------------------------------------------------------------------


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def served_model(base_url: str) -> str:
    """The model id an OpenAI endpoint serves (first entry of /v1/models)."""
    return str(get_json(f"{base_url}/v1/models")["data"][0]["id"])


def worker_counters(worker_urls: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``(prompt_tokens, cached_prompt_tokens)`` counters from each worker's /metrics."""
    out = {}
    for url in worker_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        values: dict[str, float] = {}
        for name, value in _COUNTER_RE.findall(text):
            values[name] = values.get(name, 0.0) + float(value)
        out[url] = (  # a vLLM worker reports the same two counters under its own names
            values.get(
                "kvroute_worker_prompt_tokens_total", values.get("vllm:prompt_tokens_total", 0.0)
            ),
            values.get(
                "kvroute_worker_cached_prompt_tokens_total",
                values.get("vllm:prompt_tokens_cached_total", 0.0),
            ),
        )
    return out


def counters_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """Prompt/cached token deltas per worker and the fleet's hit rate over them."""
    per = {url: (after[url][0] - before[url][0], after[url][1] - before[url][1]) for url in after}
    prompt = sum(p for p, _ in per.values())
    cached = sum(c for _, c in per.values())
    return {
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "hit_rate": cached / prompt if prompt else math.nan,
        "prompt_share": stats.load_share({url: p for url, (p, _) in per.items()}),
    }


def warm_up(worker_urls: Sequence[str], model: str) -> None:
    """One short request per worker, straight to its HTTP front, with a prompt nobody reuses.

    The first forward pass of a fresh process pays one-off costs (allocations,
    kernel selection) that would otherwise land on whichever turn-1 request
    reaches that worker first.
    """
    for i, url in enumerate(worker_urls):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"warm up number {i}: say hello"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Child processes started inside see ``OMP_NUM_THREADS=n`` (0 = leave as is).

    Two workers on a 2-core box each default to 2 intra-op threads; they then
    fight over the cores and every step pays for it.
    """
    if n <= 0:
        yield
        return
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


# -- playing the workload -------------------------------------------------------------------------


async def play(
    convs: Sequence[Conversation],
    cfg: ClientConfig,
    on_result: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Open-loop play of ``convs`` (as ``client.run_load``), calling ``on_result`` per request."""
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    out: list[RequestResult] = []

    async def conversation(session: aiohttp.ClientSession, conv: Conversation, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + conv.start_s * cfg.time_scale - time.perf_counter()))
        answers: list[str] = []
        for k, turn in enumerate(conv.turns):
            if k:
                await asyncio.sleep(turn.think_s * cfg.time_scale)
            res = await send_one(session, cfg, conv, k, answers, t0)
            out.append(res)
            if on_result is not None:
                on_result(res)
            if not res.ok:
                return  # the history is broken; later turns would be another conversation
            answers.append(res.text)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(session, c, t0) for c in convs))
    return out


def per_turn(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """Per 1-based turn: requests, mean prompt tokens, hit rate, TTFT mean/p50/p99, reasons."""
    out: dict[str, dict[str, Any]] = {}
    for turn in sorted({r.turn for r in results}):
        rows = [r for r in results if r.turn == turn and r.ok]
        ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
        lat = stats.latency_summary(ttfts)
        out[str(turn + 1)] = {
            "requests": len(rows),
            "prompt_tokens_mean": (
                sum(r.prompt_tokens for r in rows) / len(rows) if rows else math.nan
            ),
            "hit_rate": stats.hit_rate(
                [r.cached_tokens for r in rows], [r.prompt_tokens for r in rows]
            ),
            "ttft_mean_s": lat["mean"],
            "ttft_p50_s": lat["p50"],
            "ttft_p99_s": lat["p99"],
            "reasons": _reasons(rows),
        }
    return out


def _reasons(rows: Sequence[RequestResult]) -> dict[str, int]:
    """How many of ``rows`` the gateway routed for each reason ("?" = no reason header)."""
    return dict(sorted(Counter(r.headers.get(REASON_HEADER, "?") for r in rows).items()))


def summarize(results: Sequence[RequestResult], from_turn: int) -> dict[str, Any]:
    """Overall, per-turn and turn >= ``from_turn`` numbers of one policy's run."""
    ok = [r for r in results if r.ok]
    late = [r for r in ok if r.turn + 1 >= from_turn]
    start = min((r.sent_s for r in results), default=0.0)
    end = max((r.sent_s + (r.e2e_s or 0.0) for r in ok), default=0.0)
    ttft = stats.latency_summary([r.ttft_s for r in ok if r.ttft_s is not None])
    late_ttft = stats.latency_summary([r.ttft_s for r in late if r.ttft_s is not None])
    per_worker: dict[str, int] = Counter()
    for r in ok:
        per_worker[r.worker or "?"] += r.prompt_tokens
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": stats.error_summary(r.error for r in results),
        "hit_rate": stats.hit_rate([r.cached_tokens for r in ok], [r.prompt_tokens for r in ok]),
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p99_s": ttft["p99"],
        "late_turns": {
            "from_turn": from_turn,
            "requests": len(late),
            "hit_rate": stats.hit_rate(
                [r.cached_tokens for r in late], [r.prompt_tokens for r in late]
            ),
            "ttft_mean_s": late_ttft["mean"],
            "ttft_p50_s": late_ttft["p50"],
        },
        "throughput_rps": stats.throughput(len(ok), start, end),
        "output_tokens_per_s": stats.throughput(sum(r.completion_tokens for r in ok), start, end),
        "load_share": stats.load_share(dict(per_worker)),
        "reasons": _reasons(ok),
        "per_turn": per_turn(results),
    }


def acceptance(by_policy: dict[str, dict[str, Any]], from_turn: int) -> dict[str, Any]:
    """kvroute vs round_robin over turns >= ``from_turn``: hit rate and TTFT ratio."""
    if "kvroute" not in by_policy or "round_robin" not in by_policy:
        return {"checked": False, "why": "needs both kvroute and round_robin"}
    kv, rr = by_policy["kvroute"]["late_turns"], by_policy["round_robin"]["late_turns"]
    ratio = rr["ttft_mean_s"] / kv["ttft_mean_s"] if kv["ttft_mean_s"] > 0 else math.nan
    return {
        "checked": True,
        "from_turn": from_turn,
        "kvroute_hit_rate": kv["hit_rate"],
        "round_robin_hit_rate": rr["hit_rate"],
        "ttft_mean_ratio_rr_over_kvroute": ratio,
        "hit_rate_ge_90pct": kv["hit_rate"] >= 0.90,
        "ttft_2x_lower": ratio >= 2.0,
    }


def measure(
    cfg: FleetBenchConfig,
    base_url: str,
    worker_urls: Sequence[str],
    on_result: Callable[[RequestResult], None] | None = None,
) -> dict[str, Any]:
    """Warm the workers, play the workload through ``base_url``, summarize with /metrics deltas.

    ``base_url`` may be any OpenAI-compatible router in front of ``worker_urls``.
    """
    model = served_model(worker_urls[0])
    warm_up(worker_urls, model)
    before = worker_counters(worker_urls)
    scale = cfg.emulated_time_scale if cfg.engine == "emulated" else 1.0
    client = ClientConfig(base_url=base_url, model=model, ignore_eos=True, time_scale=scale)
    t0 = time.perf_counter()
    results = unscale(asyncio.run(play(chat_workload(cfg.chat()), client, on_result)), scale)
    wall_s = time.perf_counter() - t0
    out: dict[str, Any] = {"wall_s": wall_s}
    out.update(summarize(results, cfg.from_turn))
    out["worker_metrics"] = counters_delta(before, worker_counters(worker_urls))
    return out


def unscale(results: list[RequestResult], scale: float) -> list[RequestResult]:
    """Times of a run slowed down ``scale`` times (emulated engine, arrivals) back in real units.

    With ``--emulated-time-scale K`` every engine step and every arrival gap is
    K times longer, so the host's own CPU costs (HTTP, routing) shrink K-fold
    relative to the emulated GPU; dividing by K reports the emulated fleet's times.
    """
    if scale == 1.0:
        return results
    for r in results:
        r.sent_s /= scale
        r.ttft_s = None if r.ttft_s is None else r.ttft_s / scale
        r.e2e_s = None if r.e2e_s is None else r.e2e_s / scale
        r.itl_s = [gap / scale for gap in r.itl_s]
    return results


def fleet_config(cfg: FleetBenchConfig, policy: str, name: str = "") -> FleetConfig:
    """The fleet one benchmark run gets; logs under ``--log-dir/<name or policy>``."""
    return FleetConfig(
        model=cfg.model,
        workers=cfg.workers,
        policy=policy,
        num_blocks=cfg.num_blocks,
        max_num_seqs=cfg.max_num_seqs,
        log_dir=os.path.join(cfg.log_dir, name or policy) if cfg.log_dir else "",
        worker_args=emulated_worker_args(cfg),
    )


def emulated_worker_args(cfg: FleetBenchConfig) -> tuple[str, ...]:
    """The worker flags of ``--engine emulated`` (none for the real engine)."""
    if cfg.engine != "emulated":
        return ()
    scale = str(cfg.emulated_time_scale)
    return ("--engine", "emulated", "--profile", cfg.profile, "--emulated-time-scale", scale)


def run_policy(
    cfg: FleetBenchConfig,
    policy: str,
    on_result: Callable[[RequestResult], None] | None = None,
) -> dict[str, Any]:
    """A fresh fleet whose gateway routes with ``policy``, measured through that gateway."""
    t_start = time.perf_counter()
    with torch_threads(cfg.worker_threads), _fleet(cfg, policy) as fleet:
        startup_s = time.perf_counter() - t_start
        out = {"policy": policy, "startup_s": startup_s}
        out.update(measure(cfg, fleet.gateway_url, [w.http_url for w in fleet.workers], on_result))
    return out


def _fleet(cfg: FleetBenchConfig, policy: str) -> Fleet:
    """kvroute workers, or with ``--engine vllm`` vLLM servers behind bridges (same KV tokens)."""
    if cfg.engine != "vllm":
        return Fleet(fleet_config(cfg, policy))
    from loadtest.vllm_fleet import VLLM_BLOCK_SIZE, VllmFleet

    blocks = max(65, cfg.num_blocks * FleetConfig.block_size // VLLM_BLOCK_SIZE)
    return VllmFleet(replace(fleet_config(cfg, policy), startup_timeout=600.0), num_blocks=blocks)


def jsonable(obj: Any) -> Any:
    """``obj`` with NaN/inf floats as ``None``, so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def run(cfg: FleetBenchConfig, *, progress: bool = False) -> dict[str, Any]:
    """Every policy in turn, same seed; the JSON-ready result."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.users * cfg.turns * len(cfg.policies), unit="req", file=sys.stderr)
    by_policy = {}
    try:
        for policy in cfg.policies:
            if bar is not None:
                bar.set_description(policy)
            by_policy[policy] = run_policy(
                cfg, policy, (lambda _r: bar.update()) if bar is not None else None
            )
    finally:
        if bar is not None:
            bar.close()
    return {
        "config": asdict(cfg),
        "policies": by_policy,
        "acceptance": acceptance(by_policy, cfg.from_turn),
    }


# Fleet and chat-workload flags shared by bench_fleet and bench_peers: each is
# a FleetBenchConfig field of the same name.
_FLEET_FLAGS: tuple[tuple[str, type], ...] = (
    *(
        (name, int)
        for name in (
            "workers",
            "users",
            "turns",
            "system_tokens",
            "question_tokens",
            "answer_tokens",
            "seed",
            "num_blocks",
            "max_num_seqs",
            "worker_threads",
        )
    ),
    ("think_time_s", float),
    ("arrival_rate", float),
    ("engine", str),
    ("profile", str),
    ("emulated_time_scale", float),
)


def add_fleet_flags(p: argparse.ArgumentParser, d: FleetBenchConfig) -> None:
    """Adds ``--model`` and every flag in ``_FLEET_FLAGS``, defaulting to ``d``."""
    p.add_argument("--model", default=d.model, help="model folder or alias (default smollm2)")
    for name, kind in _FLEET_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(d, name))


def fleet_config_from_args(args: argparse.Namespace, **fields: Any) -> FleetBenchConfig:
    """The ``FleetBenchConfig`` the shared flags describe, plus ``fields``."""
    shared = {name: getattr(args, name) for name, _ in _FLEET_FLAGS}
    return FleetBenchConfig(model=args.model, log_dir=args.log_dir, **shared, **fields)


def build_parser() -> argparse.ArgumentParser:
    d = FleetBenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fleet_flags(p, d)
    p.add_argument("--policies", default=",".join(d.policies), help="comma-separated")
    p.add_argument("--from-turn", type=int, default=d.from_turn)
    p.add_argument("--log-dir", default="", help="keep each process's log under DIR/<policy>/")
    p.add_argument("--plot", default="", help="write the per-turn PNG here")
    p.add_argument("--json", action="store_true", help="compact JSON (default: indented)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = fleet_config_from_args(
            args,
            policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            from_turn=args.from_turn,
        )
        FleetConfig(workers=cfg.workers)  # validates --workers before anything starts
        cfg.chat()
    except ValueError as exc:
        print(f"bench_fleet: {exc}", file=sys.stderr)
        return 2
    result = run(cfg, progress=not args.no_progress)
    if args.plot:
        from loadtest.plots import plot_per_turn

        plot_per_turn(result["policies"], args.plot, title=_plot_title(cfg))
        result["plot"] = args.plot
    print(json.dumps(jsonable(result), indent=None if args.json else 2, default=str))
    errors = sum(sum(p["errors"].values()) for p in result["policies"].values())
    return 1 if errors else 0


def _plot_title(cfg: FleetBenchConfig) -> str:
    return (
        f"{cfg.workers} workers, {cfg.users} users x {cfg.turns} turns "
        f"(system {cfg.system_tokens}, question {cfg.question_tokens}, "
        f"answer {cfg.answer_tokens} tokens)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
