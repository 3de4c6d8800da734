"""The loop-lag watcher sees a blocked loop, and the gateway exports what it saw."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.observe.loop_lag import GC_BUCKETS, LAG_BUCKETS, watch_gc_pauses, watch_loop_lag
from tests.gateway.conftest import MakeGateway


async def test_a_blocked_loop_is_observed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "", buckets=LAG_BUCKETS, registry=registry)
    watcher = asyncio.create_task(watch_loop_lag(lag, interval_s=0.02, warn_s=0.05))
    try:
        await asyncio.sleep(0.1)  # a few quiet wake-ups
        with caplog.at_level(logging.WARNING, logger="gateway.observe.loop_lag"):
            time.sleep(0.2)  # what a synchronous call on the loop does to everyone
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
    total = registry.get_sample_value("lag_seconds_sum")
    count = registry.get_sample_value("lag_seconds_count")
    assert count is not None and count >= 3
    assert total is not None and 0.15 < total < 1.0
    assert registry.get_sample_value("lag_seconds_bucket", {"le": "0.1"}) < count
    assert any("event loop woke" in r.getMessage() for r in caplog.records)


async def test_the_gateway_exports_its_loop_lag(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await asyncio.sleep(0.6)  # two wake-ups of the 0.25 s watcher
    assert await _sample(gateway, "kvroute_gateway_event_loop_lag_seconds_count") >= 1


async def _sample(gateway: Any, series: str) -> float:
    """The value of ``series`` (name and labels as exported) on the gateway's /metrics."""
    async with gateway.client.get("/metrics") as resp:
        text = await resp.text()
    found = [line for line in text.splitlines() if line.startswith(series + " ")]
    assert found, f"{series} is not exported"
    return float(found[0].split()[-1])


def test_every_garbage_collection_is_timed_by_generation() -> None:
    registry = CollectorRegistry()
    pauses = Histogram("gc_seconds", "", ["generation"], buckets=GC_BUCKETS, registry=registry)
    stop = watch_gc_pauses(pauses)
    try:
        assert registry.get_sample_value("gc_seconds_count", {"generation": "1"}) == 0
        gc.collect(1)
        gc.collect()
    finally:
        stop()
    gc.collect()  # after stop: not counted
    assert registry.get_sample_value("gc_seconds_count", {"generation": "2"}) == 1
    assert registry.get_sample_value("gc_seconds_count", {"generation": "1"}) == 1
    assert registry.get_sample_value("gc_seconds_sum", {"generation": "2"}) > 0
    stop()  # twice: nothing to undo


async def test_the_gateway_exports_its_gc_pauses(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    gc.collect()
    assert await _sample(gateway, 'kvroute_gateway_gc_pause_seconds_count{generation="2"}') >= 1
