"""How late the gateway's event loop wakes up: the stall every request waiting on it shares.

A task sleeps ``interval_s`` and records how much later than asked it woke
(``kvroute_gateway_event_loop_lag_seconds``). Anything that holds the loop (a
long synchronous call, a garbage collection, a starved CPU) shows there, and a
lag over ``warn_s`` is logged with the CPU the process used meanwhile, which
tells a busy loop (CPU close to the lag) from a starved process (CPU near zero).
A stall shorter than ``interval_s`` shows only when it spans a wake-up (with
probability stall / interval), so the histogram samples stalls, it does not
count them all.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Histogram

logger = logging.getLogger(__name__)

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
