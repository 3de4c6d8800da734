"""How long a thread-pool job waits to start and to hand back, on uvloop and on asyncio's loop.

The gateway tokenizes long prompts on an executor thread. Whether that pays
depends on two hand-offs the encode itself does not show: the job waiting for
a thread to start it (the thread needs the GIL the loop holds) and the result
waiting for the loop. This probe measures both against a loop kept busy by a
task that runs ``--busy-ms`` of Python and then sleeps ``--sleep-ms``, the
pattern of a gateway under load, and prints one JSON object::

    python -m loadtest.probe_thread_handoff [--jobs 20] [--busy-ms 2] [--sleep-ms 0.5 1 0]

On uvloop a 0.5 ms sleep behaved like ``sleep(0)`` (a loop that always has
ready work), where asyncio's loop slept; the defaults show both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from loadtest.stats import percentile

_JOB_S = 0.001  # each job runs 1 ms of Python on its thread


def _spin(seconds: float) -> None:
    """Runs Python (holding the GIL) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _job() -> tuple[float, float]:
    started = time.perf_counter()
    _spin(_JOB_S)
    return started, time.perf_counter()


async def _measure(jobs: int, busy_s: float, sleep_s: float) -> dict[str, float]:
    stop = False

    async def busy() -> None:
        while not stop:
            _spin(busy_s)
            await asyncio.sleep(sleep_s)

    loop = asyncio.get_running_loop()
    spinner = loop.create_task(busy())
    to_start: list[float] = []
    to_loop: list[float] = []
    rng = random.Random(0)
    for _ in range(jobs):
        submitted = time.perf_counter()
        started, ended = await loop.run_in_executor(None, _job)
        resumed = time.perf_counter()
        to_start.append((started - submitted) * 1e3)
        to_loop.append((resumed - ended) * 1e3)
        await asyncio.sleep(0.002 * rng.random())
    stop = True
    await spinner
    return {
        "start_wait_p50_ms": round(percentile(to_start, 50), 3),
        "start_wait_p90_ms": round(percentile(to_start, 90), 3),
        "start_wait_max_ms": round(max(to_start), 3),
        "return_wait_p50_ms": round(percentile(to_loop, 50), 3),
        "return_wait_p90_ms": round(percentile(to_loop, 90), 3),
    }


def _runner(name: str) -> Callable[[Any], Any]:
    if name == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=20, help="executor jobs per loop and sleep")
    p.add_argument("--busy-ms", type=float, default=2.0, help="Python run between sleeps")
    p.add_argument(
        "--sleep-ms", type=float, nargs="+", default=[0.5, 1.0, 0.0], help="the busy task's sleeps"
    )
    args = p.parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for loop_name in ("uvloop", "asyncio"):
        run = _runner(loop_name)
        results[loop_name] = {
            f"sleep_{s:g}ms": run(_measure(args.jobs, args.busy_ms / 1e3, s / 1e3))
            for s in args.sleep_ms
        }
    out = {
        "benchmark": "thread-pool job hand-offs under a busy event loop",
        "jobs": args.jobs,
        "busy_ms": args.busy_ms,
        "results": results,
        "python": sys.version.split()[0],
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
