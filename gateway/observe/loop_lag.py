"""How late the gateway's event loop wakes up: the stall every request waiting on it shares.

A task sleeps ``interval_s`` and records how much later than asked it woke
(``kvroute_gateway_event_loop_lag_seconds``). Anything that holds the loop (a
long synchronous call, a garbage collection, a starved CPU) shows there, and a
lag over ``warn_s`` is logged with the CPU the process used meanwhile, which
tells a busy loop (CPU close to the lag) from a starved process (CPU near zero).
A stall shorter than ``interval_s`` shows only when it spans a wake-up (with
probability stall / interval), so the histogram samples stalls, it does not
count them all.

Garbage collections are stalls the watcher only samples; ``watch_gc_pauses``
times every one (``kvroute_gateway_gc_pause_seconds``, by generation), so the
GC's share of the gateway's time is a query, not a guess: at CPython's default
thresholds it was 7 % of a busy gateway's CPU (``gateway.cli`` sets others).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram

logger = logging.getLogger(__name__)

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


async def watch_loop_lag(
    histogram: Histogram, *, interval_s: float = 0.25, warn_s: float = 0.05
) -> None:
    """Runs until cancelled: one ``histogram`` observation per ``interval_s``."""
    while True:
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.sleep(interval_s)
        now = time.perf_counter()
        lag = max(0.0, now - start - interval_s)
        histogram.observe(lag)
        if lag > warn_s:
            logger.warning(
                "event loop woke %.0f ms late (process CPU %.0f ms in the last %.0f ms)",
                lag * 1e3,
                (time.process_time() - cpu) * 1e3,
                (now - start) * 1e3,
            )


def watch_gc_pauses(histogram: Histogram) -> Callable[[], None]:
    """Observes every garbage collection's duration in ``histogram`` (labelled by
    ``generation``, 0-2, each series present from the start); returns the function
    that stops watching."""
    by_generation = [histogram.labels(str(g)) for g in range(3)]
    started = 0.0

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started)

    gc.callbacks.append(on_gc)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(on_gc)

    return stop
