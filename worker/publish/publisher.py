"""Announces this worker in Redis: registry heartbeat, block set and event stream.

The engine thread calls ``EventQueue.put`` (``worker.publish.event_queue``) with
each step's KV events; it never blocks (a full queue drops the events and marks
"needs snapshot"). One asyncio task, ``Publisher``, owns every block-set and
stream write, in order:

1. sync: on start (a new epoch) and after any doubt (an outage, an overflow, a
   registry key that vanished) it writes, in one MULTI/EXEC, the registry record,
   the block set rebuilt from ``engine.resident_block_hashes()`` and an event
   batch ``[AllBlocksCleared, BlockStored(all)]`` — so the set equals the pool.
2. publish: each drained batch of events becomes one MULTI/EXEC that rewrites
   the block-set buckets it touched (``contract.redis_layout.BlockSetWriter``)
   plus one XADD with the next gap-free ``seq``.
3. heartbeat: the registry hash with current load, with a TTL, from a thread
   of its own (``worker.publish.heartbeat``), never in the same transaction
   as a block-set write: a loaded event loop or a full Redis refusing the
   set's writes does not let the registry key lapse.

Redis being down never reaches the engine: the task retries with backoff and
re-syncs when Redis answers again. ``stop`` deregisters (deletes every key of
this worker), so a clean shutdown leaves nothing stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from contract.events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEvent,
    decode_batch,
    encode_batch,
)
from contract.redis_layout import (
    EVENT_FIELD,
    STREAM_MAXLEN,
    BlockSetWriter,
    RedisLayout,
    WorkerRecord,
)
from worker.publish.event_queue import EventQueue, net_effect
from worker.publish.heartbeat import Heartbeat
from worker.publish.load_record import EngineView, with_load

logger = logging.getLogger(__name__)

_HSET_CHUNK = 1_000  # buckets per HSET, so a huge snapshot is not one giant command
# A step's cache events are published this long after the step: its outputs, handed
# to the loop in the same tick, take a few more ticks to leave as gRPC or HTTP
# writes, and publishing a prefill's blocks in between cost its first token ~0.5 ms
# (measured between the output and its write). The index learns them 2 ms later.
_PUBLISH_DELAY_S = 0.002


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how often the publisher writes."""

    redis_url: str
    worker_id: str
    namespace: str = "kvroute"
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 3.0
    max_batch_events: int = 4096
    retry_min_s: float = 0.1
    retry_max_s: float = 1.0
    op_timeout_s: float = 2.0
    # An event loop silent this long answers no gRPC call either: the heartbeat
    # thread stops and the registry key lapses. Far above any lag under load.
    loop_stall_s: float = 30.0
    cluster: bool = False  # a Redis Cluster (this worker's keys share one hash-tag slot)


class Publisher:
    """The asyncio task that keeps this worker's Redis keys equal to its engine."""

    def __init__(
        self, engine: EngineView, queue: EventQueue, config: PublisherConfig, record: WorkerRecord
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.config = config
        self.layout = RedisLayout(config.namespace)
        self.epoch = uuid.uuid4().hex
        self._record = replace(record, worker_id=config.worker_id, epoch=self.epoch)
        self._seq = 0  # the seq the next batch gets
        self._started_epoch = False  # the first sync of an epoch also clears the old stream
        self._synced = False
        self._stopping = False
        self._wake = asyncio.Event()
        self._wake_pending = False
        self._task: asyncio.Task[None] | None = None
        self._redis: Any = None  # aioredis.Redis or RedisCluster
        self.syncs = 0  # completed full syncs (tests and logs)
        self._last_snapshot_size = 0
        self._blockset = BlockSetWriter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resync = threading.Event()  # set by the heartbeat thread: Redis lost our keys
        self._ticker: asyncio.Task[None] | None = None
        self.heartbeat = Heartbeat(
            config.redis_url,
            self.layout,
            config.worker_id,
            self.current_record,
            interval=config.heartbeat_interval,
            ttl=config.heartbeat_ttl,
            op_timeout_s=config.op_timeout_s,
            loop_stall_s=config.loop_stall_s,
            on_lost=self._lost_from_thread,
            cluster=config.cluster,
        )

    @property
    def synced(self) -> bool:
        """True while Redis holds an up-to-date copy of this worker's state."""
        return self._synced

    @property
    def next_seq(self) -> int:
        return self._seq

    def update_record(self, **changes: Any) -> None:
        """Changes static registry fields (e.g. the bound address) before ``start``."""
        self._record = replace(self._record, **changes)

    async def start(self) -> None:
        """Connects lazily and starts the task; never raises for an unreachable Redis."""
        self._loop = asyncio.get_running_loop()
        factory: Any = RedisCluster.from_url if self.config.cluster else aioredis.from_url
        self._redis = factory(
            self.config.redis_url,
            socket_timeout=self.config.op_timeout_s,
            socket_connect_timeout=self.config.op_timeout_s,
            # Our own loop retries and re-syncs; a silent client-side retry of a
            # MULTI/EXEC could append a batch twice.
            retry=Retry(NoBackoff(), 0),
        )

        self.queue.set_notify(self._wake_from_thread)
        self._task = asyncio.create_task(self._run(), name="kvroute-publisher")
        self._ticker = asyncio.create_task(self._tick(), name="kvroute-publisher-tick")
        self.heartbeat.start()

    def _wake_from_thread(self) -> None:
        if self._wake_pending or self._loop is None:
            return
        self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(self._on_wake)

    def _lost_from_thread(self) -> None:
        self._resync.set()
        self._wake_from_thread()

    async def _tick(self) -> None:
        """Tells the heartbeat thread that this loop still runs (see ``loop_stall_s``)."""
        while True:
            self.heartbeat.loop_alive()
            await asyncio.sleep(self.config.heartbeat_interval)

    def _on_wake(self) -> None:
        assert self._loop is not None
        self._loop.call_later(_PUBLISH_DELAY_S, self._publish_now)

    def _publish_now(self) -> None:
        self._wake_pending = False
        self._wake.set()

    async def stop(self, deregister: bool = True) -> None:
        """Stops the task and, if asked, deletes this worker's registry, set and stream."""
        self._stopping = True
        self.queue.set_notify(None)
        # No beat may land after the keys are deleted below.
        await asyncio.to_thread(self.heartbeat.stop)
        for task in (self._task, self._ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._ticker = None
        if self._redis is None:
            return
        if deregister:
            try:
                await self._deregister()
                logger.info("worker %s deregistered from Redis", self.config.worker_id)
            except (RedisError, OSError) as exc:
                logger.warning(
                    "worker %s could not deregister: %s (its registry key expires in %.1fs)",
                    self.config.worker_id,
                    exc,
                    self.config.heartbeat_ttl,
                )
        await self._redis.aclose()
        self._redis = None
        self._synced = False

    async def _deregister(self) -> None:
        assert self._redis is not None
        wid = self.config.worker_id
        # Not a MULTI: a full Redis refuses a whole transaction, but each DEL on its own.
        async with self._redis.pipeline(transaction=False) as pipe:
            # The registry key goes first: gateways drop the worker as soon as it is gone.
            pipe.delete(self.layout.worker(wid))
            pipe.delete(self.layout.blocks(wid))
            pipe.delete(self.layout.events(wid))
            await pipe.execute()
        await self._redis.srem(self.layout.workers, wid)

    async def _run(self) -> None:
        backoff = self.config.retry_min_s
        outage_logged = False
        while not self._stopping:
            try:
                if not self._synced:
                    await self._sync()
                    if outage_logged:
                        logger.info(
                            "worker %s: Redis is back; registry and %d blocks re-sent",
                            self.config.worker_id,
                            self._last_snapshot_size,
                        )
                    outage_logged = False
                    backoff = self.config.retry_min_s
                    continue
                await self._wake.wait()
                self._wake.clear()
                if self._resync.is_set():
                    self._synced = False
                    continue
                if self.queue.take_overflow():
                    logger.warning(
                        "worker %s: event queue overflowed; sending a snapshot",
                        self.config.worker_id,
                    )
                    self._synced = False
                    continue
                events = self.queue.drain(self.config.max_batch_events)
                if events and not await self._publish(events):
                    self._synced = False
                    continue
                if len(self.queue):
                    self._wake.set()  # more than one batch was waiting
            except (RedisError, OSError, TimeoutError) as exc:
                if not outage_logged:
                    logger.warning(
                        "worker %s: Redis unavailable (%s); serving on, retrying",
                        self.config.worker_id,
                        exc,
                    )
                    outage_logged = True
            except Exception:
                # A bug here must not silently end publishing: the worker would fall
                # out of the registry while still serving.
                logger.exception("worker %s: publisher step failed", self.config.worker_id)
            else:
                continue
            self._synced = False
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.config.retry_max_s)

    async def _sync(self) -> None:
        """Writes registry + full block set + a snapshot batch in one transaction."""
        assert self._redis is not None
        wid = self.config.worker_id
        blocks_key, events_key = self.layout.blocks(wid), self.layout.events(wid)
        first = not self._started_epoch
        if not first:
            # After an outage, continue from what Redis actually holds: a batch whose
            # EXEC reply was lost may or may not have landed.
            tail: Any = await self._redis.xrevrange(events_key, count=1)
            if tail:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    last = decode_batch(bytes(tail[0][1][EVENT_FIELD.encode()]))
                    if last.epoch == self.epoch:
                        self._seq = last.seq + 1
        # Anything queued is superseded by the snapshot; later events re-apply idempotently.
        self._resync.clear()
        self.queue.discard()
        self.queue.take_overflow()
        hashes = sorted(self.engine.resident_block_hashes())
        events: list[KVEvent] = [AllBlocksCleared()]
        if hashes:
            events.append(BlockStored(tuple(hashes), None))
        seq = 0 if first else self._seq
        buckets = list(self._blockset.reset(hashes, int(self.engine.stats().num_blocks)).items())
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(blocks_key)
            if first:
                pipe.delete(events_key)
            for i in range(0, len(buckets), _HSET_CHUNK):
                pipe.hset(blocks_key, mapping=dict(buckets[i : i + _HSET_CHUNK]))
            pipe.xadd(
                events_key,
                {EVENT_FIELD: self._encode(seq, events)},
                maxlen=STREAM_MAXLEN,
                approximate=True,
            )
            self._queue_heartbeat(pipe)
            await pipe.execute()
        await self._redis.sadd(self.layout.workers, wid)
        self._seq = seq + 1
        self._started_epoch = True
        self._synced = True
        self.heartbeat.arm()
        self._last_snapshot_size = len(hashes)
        self.syncs += 1
        logger.info(
            "worker %s registered (epoch %s, %d resident blocks, seq %d)",
            wid,
            self.epoch,
            len(hashes),
            seq,
        )

    async def _publish(self, events: list[KVEvent]) -> bool:
        """One MULTI/EXEC: set changes + XADD. False when the registry key had vanished."""
        assert self._redis is not None
        wid = self.config.worker_id
        blocks_key = self.layout.blocks(wid)
        cleared, added, removed = net_effect(events)
        delete: list[str] = []
        if cleared:
            write = self._blockset.reset(added, int(self.engine.stats().num_blocks))
        else:
            write, delete = self._blockset.change(added, removed)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(self.layout.worker(wid))
            if cleared:
                pipe.delete(blocks_key)
            if write:
                pipe.hset(blocks_key, mapping=write)
            if delete:
                pipe.hdel(blocks_key, *delete)
            pipe.xadd(
                self.layout.events(wid),
                {EVENT_FIELD: self._encode(self._seq, events)},
                maxlen=STREAM_MAXLEN,
                approximate=True,
            )
            results = await pipe.execute()
        self._seq += 1
        # A missing registry key means Redis lost our state (restart, flush): re-sync.
        return bool(results[0])

    def _queue_heartbeat(self, pipe: Any) -> None:
        wid = self.config.worker_id
        key = self.layout.worker(wid)
        pipe.hset(key, mapping=self.current_record().to_mapping())
        pipe.pexpire(key, int(self.config.heartbeat_ttl * 1000))
        # The set and stream outlive a crashed worker only for a while; a live one
        # refreshes them here (an empty set has no key and needs none).
        stale_ms = int(max(60.0, 20 * self.config.heartbeat_ttl) * 1000)
        pipe.pexpire(self.layout.blocks(wid), stale_ms)
        pipe.pexpire(self.layout.events(wid), stale_ms)

    def current_record(self) -> WorkerRecord:
        """The registry record with the engine's current load."""
        return with_load(self._record, self.engine)

    def _encode(self, seq: int, events: Sequence[KVEvent]) -> bytes:
        return encode_batch(
            EventBatch(self.config.worker_id, self.epoch, seq, time.time(), tuple(events))
        )
