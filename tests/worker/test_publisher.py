"""The Redis publisher against a real Redis: registry, block set, event stream, outages.

The engine here is a tiny stand-in whose resident set and events the test
drives directly, so every expectation is exact; the publisher's behaviour
with the real engine is covered in ``test_grpc_front.py`` and ``test_worker_process.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from contract.redis_layout import EVENT_FIELD, RedisLayout, WorkerRecord, decode_block_set
from tests.support import RedisProcess
from worker.publish.event_queue import EventQueue, net_effect
from worker.publish.publisher import Publisher, PublisherConfig


@dataclass
class FakeStats:
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    num_blocks: int = 64
    free_blocks: int = 64
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclass
class FakeEngine:
    """Holds a resident set and reports each change through the queue, like the engine."""

    queue: EventQueue
    resident: set[int] = field(default_factory=set)
    load: FakeStats = field(default_factory=FakeStats)

    def stats(self) -> FakeStats:
        return self.load

    def resident_block_hashes(self) -> set[int]:
        return set(self.resident)

    def store(self, *hashes: int) -> None:
        self.resident.update(hashes)
        self.queue.put([BlockStored(hashes, None)])

    def evict(self, *hashes: int) -> None:
        self.resident.difference_update(hashes)
        self.queue.put([BlockRemoved(hashes)])


async def wait_for(predicate, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


class Harness:
    def __init__(
        self,
        url: str,
        resident: set[int] | None = None,
        queue_size: int = 1000,
        heartbeat: float = 0.2,
    ) -> None:
        self.url = url
        self.worker_id = "w-" + uuid.uuid4().hex[:8]
        self.layout = RedisLayout("t" + uuid.uuid4().hex[:10])
        self.queue = EventQueue(queue_size)
        self.engine = FakeEngine(self.queue, set(resident or ()))
        self.publisher = Publisher(
            self.engine,
            self.queue,
            PublisherConfig(
                redis_url=url,
                worker_id=self.worker_id,
                namespace=self.layout.namespace,
                heartbeat_interval=heartbeat,
                heartbeat_ttl=heartbeat * 3,
                retry_min_s=0.05,
                retry_max_s=0.2,
            ),
            WorkerRecord(
                worker_id=self.worker_id,
                address="127.0.0.1:1",
                model="m",
                hash_spec={"model": "m", "block_size": 16},
                block_size=16,
                num_blocks=64,
                max_model_len=2048,
            ),
        )
        self.redis = aioredis.from_url(url)

    async def members(self) -> set[int]:
        return set(decode_block_set(await self.redis.hvals(self.layout.blocks(self.worker_id))))

    async def batches(self):
        entries = await self.redis.xrange(self.layout.events(self.worker_id))
        return [decode_batch(fields[EVENT_FIELD.encode()]) for _, fields in entries]

    async def record(self) -> WorkerRecord | None:
        raw = await self.redis.hgetall(self.layout.worker(self.worker_id))
        return WorkerRecord.from_mapping(raw) if raw else None

    async def set_matches(self) -> bool:
        return await self.members() == self.engine.resident

    async def close(self) -> None:
        await self.publisher.stop()
        await self.redis.aclose()


@pytest.fixture
async def harness(redis_url: str):
    h = Harness(redis_url, resident={11, 12, 13})
    await h.publisher.start()
    await wait_for(lambda: _true(h.publisher.synced), what="first sync")
    yield h
    await h.close()


async def _true(value: bool) -> bool:
    return value


def test_net_effect_last_event_per_hash_wins() -> None:
    events = [BlockStored((1, 2, 3)), BlockRemoved((2,)), BlockStored((2,)), BlockRemoved((3,))]
    assert net_effect(events) == (False, {1, 2}, {3})
    assert net_effect(
        [BlockStored((1,)), AllBlocksCleared(), BlockStored((5,)), BlockRemoved((6,))]
    ) == (True, {5}, set())


def test_event_queue_overflow_drops_and_flags_once() -> None:
    queue = EventQueue(maxsize=2)
    for h in (1, 2, 3):
        queue.put([BlockStored((h,))])
    queue.put([])  # nothing to hand off: neither stored nor an overflow
    assert len(queue) == 2
    assert queue.take_overflow() is True
    assert queue.take_overflow() is False
    assert queue.drain(10) == [BlockStored((1,)), BlockStored((2,))]


async def test_start_registers_clears_first_and_snapshots(harness: Harness) -> None:
    record = await harness.record()
    assert record is not None
    assert (record.address, record.model, record.block_size, record.num_blocks) == (
        "127.0.0.1:1",
        "m",
        16,
        64,
    )
    assert record.epoch == harness.publisher.epoch and len(record.epoch) == 32
    assert record.hash_spec == {"model": "m", "block_size": 16}
    ttl = await harness.redis.pttl(harness.layout.worker(harness.worker_id))
    assert 0 < ttl <= 600
    assert await harness.redis.sismember(harness.layout.workers, harness.worker_id)
    assert await harness.members() == {11, 12, 13}
    [first] = await harness.batches()
    assert (first.worker_id, first.epoch, first.seq) == (harness.worker_id, record.epoch, 0)
    assert first.events == (AllBlocksCleared(), BlockStored((11, 12, 13), None))


async def test_events_keep_set_equal_and_seq_gap_free(harness: Harness) -> None:
    engine = harness.engine
    engine.store(1, 2, 3)
    await asyncio.sleep(0.05)
    engine.evict(2, 11)
    engine.store(4)
    await asyncio.sleep(0.05)
    engine.evict(1)
    engine.store(2)
    await wait_for(harness.set_matches, what="set == resident")
    assert await harness.members() == {2, 3, 4, 12, 13}
    batches = await harness.batches()
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert {b.epoch for b in batches} == {harness.publisher.epoch}
    assert len(batches) >= 3  # the snapshot plus at least two published batches
    replay: set[int] = set()
    for batch in batches:
        cleared, added, removed = net_effect(batch.events)
        replay = (set() if cleared else replay - removed) | added
    assert replay == engine.resident


async def test_overflow_sends_a_snapshot(redis_url: str) -> None:
    h = Harness(redis_url, queue_size=3)
    await h.publisher.start()
    try:
        await wait_for(lambda: _true(h.publisher.synced), what="first sync")
        syncs = h.publisher.syncs
        for i in range(10):  # no await: the publisher cannot drain in between
            h.engine.store(100 + i)
        await wait_for(lambda: _true(h.publisher.syncs > syncs), what="snapshot")
        await wait_for(h.set_matches, what="set == resident")
        last = (await h.batches())[-1]
        assert last.events[0] == AllBlocksCleared()
        assert set(last.events[1].block_hashes) == set(range(100, 110))
    finally:
        await h.close()


async def test_heartbeat_carries_load(harness: Harness) -> None:
    harness.engine.load = FakeStats(
        running=3, waiting=2, queued_prefill_tokens=500, free_blocks=7, prefill_tokens_per_s=1234.5
    )

    async def updated():
        record = await harness.record()
        return record is not None and record.running == 3 and record

    record = await wait_for(updated, what="heartbeat with new load")
    assert (record.waiting, record.queued_prefill_tokens, record.free_blocks) == (2, 500, 7)
    assert record.prefill_tokens_per_s == pytest.approx(1234.5)
    assert record.updated_at == pytest.approx(time.time(), abs=5)


async def test_stop_deregisters_and_leaves_nothing(redis_url: str) -> None:
    h = Harness(redis_url, resident={5})
    await h.publisher.start()
    await wait_for(lambda: _true(h.publisher.synced), what="first sync")
    await h.publisher.stop()
    wid = h.worker_id
    keys = [h.layout.worker(wid), h.layout.blocks(wid), h.layout.events(wid)]
    assert await h.redis.exists(*keys) == 0
    assert not await h.redis.sismember(h.layout.workers, wid)
    await h.redis.aclose()


async def test_restart_of_a_worker_id_starts_a_new_epoch(redis_url: str) -> None:
    h = Harness(redis_url, resident={1})
    await h.publisher.start()
    await wait_for(lambda: _true(h.publisher.synced), what="first sync")
    h.engine.store(2)
    await wait_for(h.set_matches, what="set == resident")
    await h.publisher.stop(deregister=False)  # a crash: keys stay behind
    again = Publisher(h.engine, h.queue, h.publisher.config, WorkerRecord(h.worker_id, "a:1"))
    h.engine.resident = {7}
    h.publisher = again
    await again.start()
    await wait_for(lambda: _true(again.synced), what="sync of the new epoch")
    [only] = await h.batches()  # the old epoch's stream was deleted
    assert (only.epoch, only.seq) == (again.epoch, 0)
    assert await h.members() == {7}
    await h.close()


async def test_redis_outage_then_restart_restores_set_and_registry(
    redis_process: RedisProcess,
) -> None:
    h = Harness(redis_process.url, resident={1, 2})
    await h.publisher.start()
    try:
        await wait_for(lambda: _true(h.publisher.synced), what="first sync")
        redis_process.stop(kill=True)
        h.engine.store(3, 4)
        h.engine.evict(1)
        await wait_for(lambda: _true(not h.publisher.synced), what="outage noticed")
        h.engine.store(5)
        redis_process.start()  # empty: a restart loses everything
        await wait_for(h.set_matches, timeout=5, what="set == resident after restart")
        assert await h.members() == {2, 3, 4, 5}
        record = await wait_for(h.record, what="registry back")
        assert record.epoch == h.publisher.epoch
        assert await h.redis.pttl(h.layout.worker(h.worker_id)) > 0
        batches = await h.batches()
        assert batches[0].events[0] == AllBlocksCleared()
        assert [b.seq for b in batches] == list(
            range(batches[0].seq, batches[0].seq + len(batches))
        )
    finally:
        await h.close()


async def test_redis_down_at_start_then_up(redis_process: RedisProcess) -> None:
    redis_process.stop(kill=True)
    h = Harness(redis_process.url, resident={9})
    await h.publisher.start()  # must not raise
    try:
        await asyncio.sleep(0.2)
        assert not h.publisher.synced
        redis_process.start()
        await wait_for(h.set_matches, timeout=5, what="registered once Redis is up")
        assert (await h.record()) is not None
    finally:
        await h.close()


async def test_registry_key_lost_triggers_resync(harness: Harness) -> None:
    # A FLUSHALL (or a restart the client never noticed) must not leave the set empty.
    syncs = harness.publisher.syncs
    await harness.redis.flushdb()
    await wait_for(lambda: _true(harness.publisher.syncs > syncs), what="re-sync")
    assert await harness.members() == {11, 12, 13}
    assert await harness.record() is not None


async def test_password_protected_redis() -> None:
    proc = RedisProcess(password="s3cret").start()
    try:
        h = Harness(proc.url, resident={42})
        await h.publisher.start()
        await wait_for(h.set_matches, what="registered with a password")
        await h.close()
    finally:
        proc.close()
