"""The registry heartbeat against a real Redis: apart from the block set, off the event loop.

A full Redis (``--maxmemory 2mb``, ``noeviction``) refuses the block-set write
and the record's ``HSET``, yet the registry key stays alive; an event loop kept
busy for over three TTLs, with two more threads spinning beside it, still finds its
key alive; a loop silent past ``loop_stall_s`` lets it lapse.
"""

from __future__ import annotations

import asyncio
import threading
import time

import redis

from tests.support import RedisProcess, fill_redis, make_room
from tests.worker.test_publisher import Harness, _true, wait_for

FULL_REDIS = ("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")


class _Watch:
    """Samples a key's PTTL from its own thread and connection (-2: the key is gone)."""

    def __init__(self, url: str, key: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.key = key
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(int(self.client.pttl(self.key)))
            time.sleep(0.02)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def _spin(seconds: float) -> None:
    """Pure-Python work that holds the GIL (the engine's or the loop's share of a busy CPU)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(1000))


async def test_a_full_redis_refuses_the_set_but_not_the_heartbeat() -> None:
    proc = RedisProcess(extra_args=FULL_REDIS).start()
    h = Harness(proc.url, resident={1, 2, 3})
    try:
        await h.publisher.start()
        await wait_for(lambda: _true(h.publisher.synced), what="first sync")
        filler = await asyncio.to_thread(fill_redis, proc.url)
        h.engine.store(4)  # the block-set write is refused
        await wait_for(lambda: _true(not h.publisher.synced), what="set write refused")
        await wait_for(lambda: _true(h.publisher.heartbeat.refused > 0), what="HSET refused")
        with _Watch(proc.url, h.layout.worker(h.worker_id)) as watch:
            await asyncio.sleep(4 * 0.6)  # four TTLs
            assert not h.publisher.synced  # every retry of the set was refused
        assert watch.seen and min(watch.seen) > 0, watch.seen  # alive the whole time
        assert await h.members() == {1, 2, 3}  # the refused write changed nothing
        await asyncio.to_thread(make_room, proc.url, filler, "2mb")
        # The snapshot's transaction lands before the publisher marks itself synced
        # (one more round trip adds it to the worker set): wait for the flag, then check.
        await wait_for(lambda: _true(h.publisher.synced), what="synced once Redis has room")
        assert await h.set_matches()
    finally:
        await h.close()
        proc.close()


async def test_heartbeat_outlives_a_starved_event_loop(redis_url: str) -> None:
    # Heartbeat every 0.5 s, TTL 1.5 s: the GIL is not fair among four busy threads on
    # a loaded box, so a 0.6 s TTL would measure the scheduler rather than the design.
    h = Harness(redis_url, resident={1}, heartbeat=0.5)
    try:
        await h.publisher.start()
        await wait_for(lambda: _true(h.publisher.synced), what="first sync")
        beats = h.publisher.heartbeat.beats
        spinners = [threading.Thread(target=_spin, args=(5.0,)) for _ in range(2)]
        with _Watch(redis_url, h.layout.worker(h.worker_id)) as watch:
            for t in spinners:
                t.start()
            _spin(5.0)  # the event loop itself: no await for over three TTLs
            for t in spinners:
                t.join()
        assert len(watch.seen) > 10 and min(watch.seen) > 0, watch.seen
        assert h.publisher.heartbeat.beats - beats >= 5
    finally:
        await h.close()


async def test_a_silent_event_loop_lets_the_key_lapse(redis_url: str) -> None:
    h = Harness(redis_url, resident={1})
    h.publisher.heartbeat.loop_stall_s = 0.5  # a loop stuck for good answers no call
    try:
        await h.publisher.start()
        await wait_for(lambda: _true(h.publisher.synced), what="first sync")
        with _Watch(redis_url, h.layout.worker(h.worker_id)) as watch:
            time.sleep(2.0)  # blocks the loop: no tick reaches the heartbeat thread
        assert watch.seen[-1] == -2, watch.seen[-5:]  # lapsed after stall + TTL
        await wait_for(h.record, what="registered again once the loop runs")
    finally:
        await h.close()
