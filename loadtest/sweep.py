"""The routing sweep: traces x fleet sizes x capacities x arrival rates, every policy, in the simulator.

    python -m loadtest.sweep --json docs/routing_sweep.json --markdown docs/routing_sweep.md
    # try a router change against the baselines of an earlier sweep (kvroute only re-runs):
    python -m loadtest.sweep --baselines docs/routing_sweep.json --router recompute_weight=8

For each cell (workload, arrival rate, fleet size, per-worker capacity) every
policy of ``loadtest.fleetsim.SIM_POLICIES`` replays the same shapes through
the simulator (the production ``Router`` for kvroute's policies). A cell
passes when kvroute's hit rate is within ``--hit-tolerance`` of the best
baseline's and its TTFT p99 within ``--p99-tolerance`` of the best
baseline's; the table reports both margins and names the baseline that set
each bar. ``target_met`` is computed from every cell.

Workloads: ``mooncake`` (the conversation trace, 512-token blocks, its own
timestamps scaled by the rate factor), ``chat`` (multi-turn users with a
shared system prompt) and ``zipf_prefix`` (a few long shared prefixes with
Zipf popularity, the traffic a prefix-threshold router like SGLang's is built
for), both with 16-token blocks, and ``bursty`` (the two mixed, every arrival of
each 20 s window squeezed into its first 4 s: five times the mean rate, then
silence), and ``mooncake_32`` (the trace rescaled to 32-token blocks as
``bench_peers`` replays it through aiperf on emulated workers: its first 500
requests, 16-token engine blocks, sped up 4x and 8x).

With ``--replicas N`` each cell also runs kvroute as N gateway replicas taking
requests in turn (``SimConfig.replicas``: each hears what the others routed
``replica_lag_s`` late) and compares them with one gateway: a cell's replicas
pass when their hit rate is within ``--hit-tolerance`` of one gateway's and
their TTFT p99 within ``--p99-tolerance``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from contract.hashing import HashSpec
from loadtest.aiperf_client import rescale_trace
from loadtest.fleetsim import SIM_POLICIES, SimConfig
from loadtest.mooncake_trace import (
    TRACE_ARRIVALS,
    TraceChains,
    TraceTokens,
    load_trace,
    spread_arrivals,
)
from loadtest.simulate import router_options, run_policy
from loadtest.workloads import (
    Conversation,
    RequestShape,
    bursty,
    conversation_shapes,
    synthetic_workload,
)

logger = logging.getLogger(__name__)

TRACE = Path(__file__).with_name("traces") / "mooncake_conversation_trace.jsonl"
FLEET_SIZES = (4, 8, 16, 32)
# Baselines kvroute must match or beat ("session" and "least_loaded" included).
BASELINES = tuple(p for p in SIM_POLICIES if p != "kvroute")


@dataclass(frozen=True)
class Workload:
    """A workload family: its block size, its two capacities and its two rate factors."""

    name: str
    block_size: int
    capacities: tuple[int, int]  # per-worker tokens: tight, ample
    rates: tuple[float, float]  # arrival-rate multipliers: base, double


WORKLOADS = {
    "mooncake": Workload("mooncake", 512, (300_000, 3_000_000), (1.0, 2.0)),
    "chat": Workload("chat", 16, (16_384, 262_144), (1.0, 2.0)),
    "zipf_prefix": Workload("zipf_prefix", 16, (16_384, 262_144), (1.0, 2.0)),
    "bursty": Workload("bursty", 16, (16_384, 262_144), (1.0, 2.0)),
    # The trace as bench_peers replays it on emulated workers: 32-token trace blocks.
    "mooncake_32": Workload("mooncake_32", 16, (16_384, 65_536), (4.0, 8.0)),
}
PEERS_REPLAY_REQUESTS = 500  # loadtest.peers_matrix's trace_limit


def shapes_for(
    w: Workload, rate: float, limit: int, seed: int, *, spread: bool = False
) -> list[RequestShape]:
    """The simulator shapes of workload ``w`` at ``rate`` times its base arrival rate;
    ``spread``: the trace's simultaneous requests spread over their 3 s instants
    (``loadtest.mooncake_trace.spread_arrivals``)."""
    spec = HashSpec(block_size=w.block_size, model="sweep")
    if w.name == "mooncake":
        records = load_trace(TRACE, limit=limit, time_scale=1.0 / rate)
        records = spread_arrivals(records) if spread else records
        return list(TraceChains(spec, TraceTokens(seed=seed)).shapes(records))
    if w.name == "mooncake_32":
        # As long as bench_peers' replay: the first requests, while caches still fill.
        n = min(limit, PEERS_REPLAY_REQUESTS)
        with tempfile.TemporaryDirectory() as tmp:
            rescaled = Path(tmp) / "rescaled.jsonl"
            rescale_trace(TRACE, rescaled, block_tokens=32, limit=n)
            records = load_trace(rescaled, limit=n, time_scale=1.0 / rate)
        records = spread_arrivals(records) if spread else records
        tokens = TraceTokens(block_tokens=32, seed=seed)
        return list(TraceChains(spec, tokens).shapes(records))
    if w.name == "bursty":
        chat = _synthetic("chat", rate, seed, users=64)
        groups = _synthetic("zipf_prefix", rate * 0.5, seed + 1, groups=12, system_tokens=2000)
        return conversation_shapes(bursty([*chat, *groups]), spec)
    return conversation_shapes(_synthetic(w.name, rate, seed), spec)


def _synthetic(name: str, rate: float, seed: int, **override: Any) -> list[Conversation]:
    """The ``chat`` or ``zipf_prefix`` conversations at ``rate`` times the base arrival rate."""
    chat = name == "chat"
    args = SimpleNamespace(
        workload="chat" if chat else "shared-prefix",
        users=128,
        turns=4,
        system_tokens=1000 if chat else 3000,
        question_tokens=64,
        answer_tokens=128 if chat else 32,
        think_time_s=3.0,
        arrival_rate=(2.0 if chat else 16.0) * rate,
        groups=24,
        prompts_per_group=32,
        zipf=1.1,
        seed=seed,
    )
    for key, value in override.items():
        setattr(args, key, value)
    return synthetic_workload(args)


def run_cell(
    w: Workload,
    shapes: Sequence[RequestShape],
    workers: int,
    capacity: int,
    *,
    router: tuple[tuple[str, object], ...] = (),
    known: dict[str, dict[str, float]] | None = None,
    replicas: int = 1,
) -> dict[str, dict[str, float]]:
    """Every policy's figures in one cell; ``known`` baselines are reused, not re-run.

    With ``replicas`` > 1, kvroute as that many gateway replicas too, under
    ``replicas_key(replicas)``.
    """
    out = {}
    runs = [(policy, 1) for policy in SIM_POLICIES]
    if replicas > 1:
        runs.append(("kvroute", replicas))
    for policy, n in runs:
        key = policy if n == 1 else replicas_key(n)
        if known and policy != "kvroute" and policy in known:
            out[key] = known[policy]
            continue
        cfg = SimConfig(
            workers=workers,
            block_size=w.block_size,
            capacity_tokens=capacity,
            policy=policy,
            router_options=router if policy == "kvroute" else (),
            replicas=n,
        )
        r = run_policy(cfg, shapes, progress=False)
        out[key] = {k: r[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "load_cov")}
    return out


def replicas_key(n: int) -> str:
    return f"kvroute_{n}_replicas"


def replica_margins(
    cell: dict[str, dict[str, float]], n: int, hit_tol: float, p99_tol: float
) -> dict[str, Any]:
    """kvroute as ``n`` replicas against one kvroute gateway in one cell."""
    one, many = cell["kvroute"], cell[replicas_key(n)]
    hit_margin = many["hit_rate"] - one["hit_rate"]
    p99_ratio = many["ttft_p99_s"] / one["ttft_p99_s"]
    return {
        "hit_margin": hit_margin,
        "p99_ratio": p99_ratio,
        "passes": hit_margin >= -hit_tol and p99_ratio <= 1.0 + p99_tol,
    }


def stored_baselines(
    path: Path, seed: int, limit: int, trace_arrivals: str = "recorded"
) -> dict[tuple[str, float, int, int], Any]:
    """The policies of each cell of an earlier sweep run with the same seed, limit and
    trace arrivals."""
    data = json.loads(path.read_text())
    if data.get("seed", 0) != seed or data.get("limit", 3000) != limit:
        raise ValueError(f"--baselines {path}: it was run with another --seed or --limit")
    if data.get("trace_arrivals", "recorded") != trace_arrivals:
        raise ValueError(f"--baselines {path}: it was run with another --trace-arrivals")
    return {
        (c["workload"], c["rate"], c["workers"], c["capacity_tokens"]): c["policies"]
        for c in data["cells"]
    }


def margins(cell: dict[str, dict[str, float]], hit_tol: float, p99_tol: float) -> dict[str, Any]:
    """kvroute against the best baseline on hit rate and on TTFT p99 in one cell."""
    kv = cell["kvroute"]
    best_hit = max(BASELINES, key=lambda p: cell[p]["hit_rate"])
    best_p99 = min(BASELINES, key=lambda p: cell[p]["ttft_p99_s"])
    hit_margin = kv["hit_rate"] - cell[best_hit]["hit_rate"]
    p99_ratio = kv["ttft_p99_s"] / cell[best_p99]["ttft_p99_s"]
    return {
        "hit_margin": hit_margin,
        "best_hit_baseline": best_hit,
        "p99_ratio": p99_ratio,
        "best_p99_baseline": best_p99,
        "passes": hit_margin >= -hit_tol and p99_ratio <= 1.0 + p99_tol,
    }


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    cells = []
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    sizes = [int(s) for s in args.fleet_sizes.split(",")]
    router = router_options(args.router)
    known = (
        stored_baselines(args.baselines, args.seed, args.limit, args.trace_arrivals)
        if args.baselines
        else {}
    )
    for name in names:
        w = WORKLOADS[name]
        for rate in w.rates:
            shapes = shapes_for(
                w, rate, args.limit, args.seed, spread=args.trace_arrivals == "spread"
            )
            for workers, capacity in itertools.product(sizes, w.capacities):
                t0 = time.perf_counter()
                cell = run_cell(
                    w,
                    shapes,
                    workers,
                    capacity,
                    router=router,
                    known=known.get((name, rate, workers, capacity)),
                    replicas=args.replicas,
                )
                row = {
                    "workload": name,
                    "rate": rate,
                    "workers": workers,
                    "capacity_tokens": capacity,
                    "requests": len(shapes),
                    "policies": cell,
                    **margins(cell, args.hit_tolerance, args.p99_tolerance),
                }
                if args.replicas > 1:
                    row["replicas"] = replica_margins(
                        cell, args.replicas, args.hit_tolerance, args.p99_tolerance
                    )
                cells.append(row)
                logger.info(
                    "%s x%.0f %d workers %d tokens: hit %+.4f (%s), p99 x%.3f (%s) %.0fs",
                    name,
                    rate,
                    workers,
                    capacity,
                    row["hit_margin"],
                    row["best_hit_baseline"],
                    row["p99_ratio"],
                    row["best_p99_baseline"],
                    time.perf_counter() - t0,
                )
    out: dict[str, Any] = {
        "cells": cells,
        "hit_tolerance": args.hit_tolerance,
        "p99_tolerance": args.p99_tolerance,
        "cells_passing": sum(c["passes"] for c in cells),
        "cells_total": len(cells),
        "target_met": all(c["passes"] for c in cells),
        "seed": args.seed,
        "limit": args.limit,
        "trace_arrivals": args.trace_arrivals,
        "router": dict(router),
        "command": "python -m loadtest.sweep " + " ".join(args.argv),
    }
    if args.replicas > 1:
        out["replicas"] = args.replicas
        out["replicas_cells_passing"] = sum(c["replicas"]["passes"] for c in cells)
        out["replicas_target_met"] = all(c["replicas"]["passes"] for c in cells)
    return out


def markdown(result: dict[str, Any]) -> str:
    """The sweep as a table: one row per cell, kvroute's margins against the best baseline."""
    lines = [
        "| workload | rate | workers | capacity/worker | kvroute hit | best baseline hit "
        "| hit margin | kvroute p99 | best baseline p99 | p99 ratio | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    n = result.get("replicas", 1)
    if n > 1:
        lines[0] += f" {n} replicas: hit margin | p99 ratio | pass |"
        lines[1] += "---|---|---|"
    for c in result["cells"]:
        p = c["policies"]
        bh, bp = c["best_hit_baseline"], c["best_p99_baseline"]
        line = (
            f"| {c['workload']} | x{c['rate']:g} | {c['workers']} | {c['capacity_tokens']:,} "
            f"| {p['kvroute']['hit_rate']:.4f} | {p[bh]['hit_rate']:.4f} ({bh}) "
            f"| {c['hit_margin']:+.4f} | {_s(p['kvroute']['ttft_p99_s'])} "
            f"| {_s(p[bp]['ttft_p99_s'])} ({bp}) | {c['p99_ratio']:.3f} "
            f"| {'yes' if c['passes'] else '**no**'} |"
        )
        if n > 1:
            r = c["replicas"]
            line += (
                f" {r['hit_margin']:+.4f} | {r['p99_ratio']:.3f} "
                f"| {'yes' if r['passes'] else '**no**'} |"
            )
        lines.append(line)
    return "\n".join(lines) + "\n"


def _s(seconds: float) -> str:
    return "nan" if math.isnan(seconds) else f"{seconds:.2f} s"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--fleet-sizes", default=",".join(str(s) for s in FLEET_SIZES))
    p.add_argument("--limit", type=int, default=3000, help="Mooncake requests replayed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hit-tolerance", type=float, default=0.005)
    p.add_argument("--p99-tolerance", type=float, default=0.05)
    p.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a RouterConfig field for kvroute's runs (repeatable)",
    )
    p.add_argument(
        "--baselines",
        type=Path,
        help="reuse the other policies' figures from this earlier sweep JSON",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="also run kvroute as this many gateway replicas and compare with one (default 1: no)",
    )
    p.add_argument(
        "--trace-arrivals",
        choices=TRACE_ARRIVALS,
        default="recorded",
        help="the Mooncake workloads' arrivals: as recorded (about ten requests at each "
        "3 s instant) or spread evenly over each instant's 3 s",
    )
    p.add_argument("--json", type=Path, help="write the full result here")
    p.add_argument("--markdown", type=Path, help="write the table here")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = sweep(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result))
    summary = {k: v for k, v in result.items() if k != "cells"}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
