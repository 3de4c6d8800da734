"""A gateway's memory under minutes of one workload: resident set before and after.

``bench_overhead``'s rounds last seconds; what a gateway keeps per request for
longer (a request's speculative hold lasts up to the first-token timeout, a
minute by default) shows only over a longer run. Starts the gateway in front of
``bench_overhead``'s instant fakes (optionally also one from another checkout,
e.g. a ``git worktree`` of an earlier commit, one after the other on the same
fakes), loads it for ``--seconds`` at ``--concurrency`` and prints one JSON
object per router: ``rss_mb_before``, ``rss_mb_after``, ``requests``, ``rps``.

    python -m loadtest.gateway_memory --workload chat_6k_cold --seconds 75
    python -m loadtest.gateway_memory --baseline-tree /tmp/kvroute-base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from loadtest.bench_overhead import (
    ROOT,
    WORKLOADS,
    FakeFleet,
    _load,
    fake_fleet,
    make_bodies,
)
from loadtest.fleet import sigterm_as_ctrl_c


def measure(
    tree: Path, workload: str, seconds: float, concurrency: int, fleet: FakeFleet
) -> dict[str, Any]:
    """One gateway from ``tree`` loaded for ``seconds``; its RSS before and after."""
    proc = fleet.router("kvroute", tree)
    try:
        bodies = make_bodies(workload, 200, seed=0)
        proc.wait_ready(bodies[0])
        before = proc.ps.memory_info().rss
        run = asyncio.run(_load(proc.url, bodies, concurrency, seconds))
        after = proc.ps.memory_info().rss
    finally:
        proc.close()
    n = len(run["latencies_ms"])
    return {
        "tree": str(tree),
        "rss_mb_before": before >> 20,
        "rss_mb_after": after >> 20,
        "requests": n,
        "rps": round(n / seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.gateway_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workload", default="chat_6k_cold", choices=WORKLOADS)
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--baseline-tree", type=Path, help="another checkout, measured first")
    args = parser.parse_args(argv)
    trees = [args.baseline_tree, ROOT] if args.baseline_tree else [ROOT]
    with sigterm_as_ctrl_c(), fake_fleet(4) as fleet:
        runs = [measure(t, args.workload, args.seconds, args.concurrency, fleet) for t in trees]
    print(
        json.dumps(
            {
                "benchmark": "gateway resident memory under one workload",
                "workload": args.workload,
                "seconds": args.seconds,
                "concurrency": args.concurrency,
                "runs": runs,
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "command": "python -m loadtest.gateway_memory "
                + " ".join(sys.argv[1:] if argv is None else argv),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
