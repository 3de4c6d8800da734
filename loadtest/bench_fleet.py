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
per turn, one line per policy. What is asked of the workers outside the workload
is ``loadtest.fleet_probe``; the summaries and the acceptance check are
``loadtest.fleet_summary``, the plot ``loadtest.plots``.

Usage: ``python -m loadtest.bench_fleet --workers 2 --policies kvroute,round_robin
[--users 6 --turns 4 --model smollm2 --plot docs/bench_fleet.png --json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import aiohttp

from loadtest.client import ClientConfig, RequestResult, send_one
from loadtest.fleet import Fleet, FleetConfig, sigterm_as_ctrl_c
from loadtest.fleet_probe import counters_delta, served_model, warm_up, worker_counters
from loadtest.fleet_summary import acceptance, jsonable, summarize, unscale
from loadtest.workloads import ChatConfig, Conversation, chat_workload

logger = logging.getLogger(__name__)

ENGINES = ("torch", "emulated", "vllm")  # vllm: real vLLM CPU servers behind bridges
# The GPU profile the README's fleet-scale figures use (worker/model/profiles/).
DEFAULT_PROFILE = "h100-llama3.1-8b"


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
    with sigterm_as_ctrl_c():
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
