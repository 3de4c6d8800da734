"""What one ``kvroute`` routing decision costs, per fleet size, on each of the router's paths.

``Router.choose`` scores fleets of up to ``SMALL_FLEET`` workers in plain
Python and larger ones as numpy columns (the same decisions, bit for bit:
``tests/gateway/test_router.py``). This times both paths on the same random
fleets (a third of the workers holding a prefix of the request, random
queues), interleaved, and reports the median microseconds per decision, so
the crossover ``SMALL_FLEET`` is a measurement, not a guess.

Prints one JSON object: ``{"sizes": {N: {"plain_us", "numpy_us", "plain_vs_numpy"}},
"small_fleet": SMALL_FLEET, "plain_faster_up_to": N, "load_average"}``.

    python -m loadtest.bench_router_paths            # ~20 s
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

from gateway.routing.router import (
    SMALL_FLEET,
    Decision,
    Router,
    RouterConfig,
    RouteRequest,
    WorkerState,
)

SIZES = (1, 2, 4, 8, 16, 24, 32, 64)


def _fleet(rng: random.Random, n: int) -> list[WorkerState]:
    return [
        WorkerState(
            f"w{i:04d}",
            cached_blocks=rng.choice([0, 0, 4, 40]),
            running=rng.randrange(8),
            waiting=rng.randrange(3),
            queued_prefill_tokens=rng.randrange(0, 20_000),
            prefill_tokens_per_s=9000.0,
            inflight=rng.randrange(8),
            pending=rng.randrange(2),
            held_blocks=rng.randrange(0, 20_000),
            capacity_blocks=20_000,
        )
        for i in range(n)
    ]


def _time(route: Callable[[RouteRequest, list[WorkerState]], Decision], cases: list) -> float:
    """Microseconds per decision over ``cases``."""
    start = time.perf_counter()
    for request, ws in cases:
        route(request, ws)
    return (time.perf_counter() - start) * 1e6 / len(cases)


def run(sizes: tuple[int, ...], decisions: int, rounds: int) -> dict:
    rng = random.Random(0)
    router = Router(RouterConfig(recompute_weight=12.0))
    out: dict[str, dict[str, float]] = {}
    for n in sizes:
        cases = [
            (RouteRequest(prompt_tokens=2000, block_size=16), _fleet(rng, n))
            for _ in range(decisions)
        ]
        plain, columns = [], []
        for _ in range(rounds):  # interleaved, so both see the same machine
            plain.append(_time(router._kvroute_small, cases))
            columns.append(_time(router._kvroute, cases))
        p, c = round(statistics.median(plain), 1), round(statistics.median(columns), 1)
        out[str(n)] = {"plain_us": p, "numpy_us": c, "plain_vs_numpy": round(p / c, 3)}
    faster = [n for n in sizes if out[str(n)]["plain_vs_numpy"] < 1.0]
    return {
        "sizes": out,
        "small_fleet": SMALL_FLEET,
        "plain_faster_up_to": max(faster) if faster else 0,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_router_paths", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--decisions", type=int, default=2000, help="per size and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s)
    print(json.dumps(run(sizes, args.decisions, args.rounds), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
