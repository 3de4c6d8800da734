"""``python -m loadtest.simulate``: replay a workload through the production router and a
simulated fleet, and report token hit rate, load balance and TTFT per policy.

    python -m loadtest.simulate --trace loadtest/traces/mooncake_conversation_trace.jsonl \\
        --block-size 512 --workers 8 --capacity-tokens 3000000 --policy all --json

The workload is a Mooncake-format trace (``--trace``), or a synthetic
multi-turn chat (``--workload chat``) or shared-prefix groups
(``--workload shared-prefix``). ``--json`` prints one JSON object (a list for
``--policy all``); otherwise a table. ``--plot`` writes a PNG comparison.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from contract.hashing import HashSpec
from gateway.routing.router import RouterConfig
from loadtest import stats
from loadtest.fleetsim import (
    SIM_POLICIES,
    FleetSimulation,
    RequestRecord,
    SimConfig,
    ideal_hit_rate,
)
from loadtest.mooncake_trace import TraceChains, TraceTokens, load_trace
from loadtest.workloads import RequestShape, conversation_shapes, synthetic_workload

log = logging.getLogger(__name__)


def summarize(cfg: SimConfig, records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The report of one simulated run (every number a plain float or int)."""
    done = [r for r in records if not math.isnan(r.finish_s)]
    prompt = [r.shape.prompt_tokens for r in done]
    cached = [r.cached_tokens for r in done]
    per_worker = {wid: 0 for wid in (f"w{i}" for i in range(cfg.workers))}
    for r in done:
        per_worker[r.worker] += r.shape.prompt_tokens
    ttft = [r.ttft_s for r in done]
    e2e = [r.finish_s - r.arrival_s for r in done]
    wait = [r.start_s - r.arrival_s for r in done]
    hit = stats.hit_rate(cached, prompt)
    ideal = ideal_hit_rate(records, cfg.block_size)
    end = max((r.finish_s for r in done), default=0.0)
    start = min((r.arrival_s for r in done), default=0.0)
    return {
        "policy": cfg.policy,
        "requests": len(done),
        "hit_rate": hit,
        "ideal_hit_rate": ideal,
        "hit_vs_ideal": hit / ideal if ideal else math.nan,
        "predicted_hit_rate": stats.hit_rate((r.predicted_cached_tokens for r in done), prompt),
        "load_cov": stats.coefficient_of_variation(list(per_worker.values())),
        "load_share": stats.load_share(per_worker),
        "worker_hit_rate": stats.grouped_hit_rate(
            (r.worker, r.cached_tokens, r.shape.prompt_tokens) for r in done
        ),
        "turn_hit_rate": stats.grouped_hit_rate(
            (r.shape.turn, r.cached_tokens, r.shape.prompt_tokens) for r in done
        ),
        "ttft_p50_s": stats.percentile(ttft, 50),
        "ttft_p95_s": stats.percentile(ttft, 95),
        "ttft_p99_s": stats.percentile(ttft, 99),
        "ttft_mean_s": stats.latency_summary(ttft)["mean"],
        "queue_wait_p99_s": stats.percentile(wait, 99),
        "e2e_p50_s": stats.percentile(e2e, 50),
        "e2e_p99_s": stats.percentile(e2e, 99),
        "throughput_rps": stats.throughput(len(done), start, end),
        "reasons": dict(sorted(Counter(r.reason for r in done).items())),
        "evictions": 0,
        "simulated_s": end - start,
        "wall_s": wall_s,
    }


def run_policy(cfg: SimConfig, shapes: Sequence[RequestShape], *, progress: bool) -> dict[str, Any]:
    """Simulate ``shapes`` under ``cfg`` and summarize, with an optional stderr progress bar."""
    sim = FleetSimulation(cfg)
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(shapes),
            desc=cfg.policy,
            unit="req",
            file=sys.stderr,
            mininterval=0.5,
            leave=False,
        )
    records = sim.run(shapes, on_finish=(lambda _: bar.update()) if bar is not None else None)
    if bar is not None:
        bar.close()
    out = summarize(cfg, records, time.perf_counter() - t0)
    out["evictions"] = sum(w.cache.evictions for w in sim.workers.values())
    return out


def build_shapes(args: argparse.Namespace) -> list[RequestShape]:
    """The workload the flags describe, as simulator shapes."""
    spec = HashSpec(block_size=args.block_size, model=args.model)
    if args.trace is not None:
        trace, tokens = args.trace, TraceTokens(seed=args.seed)
        if args.trace_block_tokens:
            # The trace as bench_peers replays it through aiperf: blocks of fewer tokens.
            from loadtest.aiperf_client import rescale_trace

            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "rescaled.jsonl"
                rescale_trace(
                    args.trace,
                    trace,
                    block_tokens=args.trace_block_tokens,
                    limit=args.limit or 10**9,
                )
                records = load_trace(trace, limit=args.limit, time_scale=args.time_scale)
            tokens = TraceTokens(block_tokens=args.trace_block_tokens, seed=args.seed)
        else:
            records = load_trace(trace, limit=args.limit, time_scale=args.time_scale)
        return list(TraceChains(spec, tokens).shapes(records))
    convs = synthetic_workload(args)
    shapes = conversation_shapes(convs, spec)
    return shapes[: args.limit] if args.limit else shapes


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of the headline numbers, one row per policy."""
    cols = [
        ("policy", "{:<13}"),
        ("requests", "{:>8}"),
        ("hit_rate", "{:>8.4f}"),
        ("ideal_hit_rate", "{:>14.4f}"),
        ("hit_vs_ideal", "{:>12.3f}"),
        ("load_cov", "{:>8.3f}"),
        ("ttft_p50_s", "{:>10.3f}"),
        ("ttft_p99_s", "{:>10.3f}"),
        ("e2e_p99_s", "{:>9.2f}"),
    ]
    head = " ".join(
        f"{name:>{len(fmt.format(results[0][name]))}}" if i else f"{name:<13}"
        for i, (name, fmt) in enumerate(cols)
    )
    rows = [" ".join(fmt.format(r[name]) for name, fmt in cols) for r in results]
    return "\n".join([head, *rows])


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Hit rate vs ideal, per-worker load share and TTFT percentiles, one bar group per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in results]
    x = range(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    ax.bar(x, [r["hit_rate"] for r in results], color="tab:blue")
    ax.axhline(
        results[0]["ideal_hit_rate"], color="k", ls="--", label="ideal (one unlimited cache)"
    )
    ax.set_title("token hit rate")
    ax.legend(loc="upper right")
    ax = axes[1]
    n_workers = len(results[0]["load_share"])
    width = 0.8 / n_workers
    for j, wid in enumerate(sorted(results[0]["load_share"])):
        ax.bar(
            [i + j * width - 0.4 for i in x],
            [r["load_share"][wid] for r in results],
            width=width,
            label=wid,
        )
    ax.axhline(1.0 / n_workers, color="k", ls="--")
    ax.set_title("share of prompt tokens per worker")
    ax = axes[2]
    ax.bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in results], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["ttft_p99_s"] for r in results], width=0.4, label="p99")
    ax.set_yscale("log")
    ax.set_title("TTFT (s)")
    ax.legend()
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_NOT_FLAGS = ("policy", "router_options")


def router_options(items: Sequence[str]) -> tuple[tuple[str, object], ...]:
    """``KEY=VALUE`` strings as typed ``RouterConfig`` overrides (``ValueError`` if unknown)."""
    known = {f.name: f for f in fields(RouterConfig)}
    defaults = RouterConfig()
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known or key == "policy":
            raise ValueError(
                f"--router {item!r}: expected KEY=VALUE with KEY one of "
                f"{', '.join(k for k in known if k != 'policy')}"
            )
        kind = type(getattr(defaults, key))
        try:
            value: object = (raw.lower() in ("1", "true", "yes")) if kind is bool else kind(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--router {item!r}: {exc}") from exc
        out.append((key, value))
    return tuple(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("workload")
    src.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace to replay")
    src.add_argument(
        "--workload",
        choices=("chat", "shared-prefix"),
        default="chat",
        help="synthetic workload when no --trace is given",
    )
    src.add_argument("--limit", type=int, help="replay only the first N requests")
    src.add_argument(
        "--trace-block-tokens",
        type=int,
        default=0,
        help="rescale the trace's 512-token blocks to this many tokens (as bench_peers does)",
    )
    src.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply trace arrival times (0.5 = twice the rate)",
    )
    src.add_argument("--users", type=int, default=64)
    src.add_argument("--turns", type=int, default=4)
    src.add_argument("--groups", type=int, default=8)
    src.add_argument("--prompts-per-group", type=int, default=16)
    src.add_argument("--zipf", type=float, default=0.0, help="shared-prefix group popularity")
    src.add_argument("--system-tokens", type=int, default=500)
    src.add_argument("--question-tokens", type=int, default=50)
    src.add_argument("--answer-tokens", type=int, default=200)
    src.add_argument("--think-time-s", type=float, default=2.0)
    src.add_argument("--arrival-rate", type=float, default=1.0)
    src.add_argument("--model", default="", help="model name folded into the hash seed")
    d = SimConfig()
    fl = p.add_argument_group("fleet and policy")
    fl.add_argument("--policy", default="kvroute", help=f"one of {', '.join(SIM_POLICIES)}, or all")
    for f in fields(SimConfig):
        if f.name in _NOT_FLAGS:
            continue
        default = getattr(d, f.name)
        fl.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"(default {default})",
        )
    fl.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a further gateway.routing.router.RouterConfig field (repeatable)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--plot", type=Path, help="write a PNG comparing the policies")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    policies = list(SIM_POLICIES) if args.policy == "all" else [args.policy]
    base = {f.name: getattr(args, f.name) for f in fields(SimConfig) if f.name not in _NOT_FLAGS}
    try:
        base["router_options"] = router_options(args.router)
        configs = [SimConfig(policy=name, **base) for name in policies]
        shapes = build_shapes(args)
    except ValueError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    results = [run_policy(cfg, shapes, progress=progress) for cfg in configs]
    if args.plot is not None:
        plot(results, args.plot)
        log.info("wrote %s", args.plot)
    if args.json:
        print(json.dumps(results if args.policy == "all" else results[0], indent=None))
    else:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
