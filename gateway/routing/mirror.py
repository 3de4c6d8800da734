"""Keeps the gateway's ``BlockIndex`` and worker list in step with Redis.

Three duties, all on the event loop:

1. Discovery: every ``poll_s`` read the members of ``layout.workers`` and
   ``HGETALL`` each registry key. A missing key is a dead worker: it and all
   its blocks leave the index. A new worker (or a new epoch) is loaded.
2. Load: read a worker's block set and its stream's last entry in one MULTI,
   so the snapshot and the stream position agree, then replace its blocks.
3. Tail: ``XREAD BLOCK`` every loaded worker's stream from its last id and
   apply the batches. A new epoch or a ``seq`` gap reloads that worker.

When Redis goes away the last mirror stays (routing keeps working on it);
the mirror reconnects with backoff and reloads everything once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from contract.hashing import HASH_VERSION, HashSpec
from contract.redis_layout import EVENT_FIELD, RedisLayout, WorkerRecord
from contract.redis_url import redact
from gateway.routing.index import BlockIndex

logger = logging.getLogger(__name__)

_TAIL_BLOCK_MS = 250  # short, so newly discovered workers join the XREAD quickly
_TAIL_COUNT = 1000
_MAX_BACKOFF_S = 5.0


@dataclass
class WorkerEntry:
    """What the mirror knows about one live worker."""

    record: WorkerRecord
    spec: HashSpec | None  # None: the worker's hash spec is not one this gateway computes
    stream_id: str = "0-0"
    epoch: str = ""
    seq: int | None = None  # None: no batch seen yet, accept whatever comes next
    loaded: bool = False
    event_lag_s: float = 0.0


def spec_from_record(record: WorkerRecord) -> HashSpec | None:
    """The ``HashSpec`` (without tenant salt) a worker advertises, or None if unusable."""
    raw = record.hash_spec
    if not raw or raw.get("version", HASH_VERSION) != HASH_VERSION:
        return None
    try:
        return HashSpec(
            block_size=int(raw.get("block_size", record.block_size)),
            model=str(raw.get("model", "")),
            revision=str(raw.get("revision", "")),
            lora=str(raw.get("lora", "")),
        )
    except (TypeError, ValueError):
        return None


def _stream_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _raise_if_cancelled() -> None:
    """Re-raises a cancellation that a library swallowed.

    redis-py can catch the ``CancelledError`` meant for a command and carry on;
    the task's ``cancelling()`` count still says it was cancelled, so loops
    check it and stop instead of running forever (and hanging shutdown).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class IndexMirror:
    """The Redis side of the gateway: registry, block sets, event streams."""

    def __init__(
        self,
        redis_url: str,
        layout: RedisLayout,
        index: BlockIndex,
        *,
        poll_s: float = 0.5,
        reconnect_grace_s: float = 5.0,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.layout = layout
        self.index = index
        self.poll_s = poll_s
        # A Redis that just came back may be empty until every worker's
        # publisher re-registers (up to a heartbeat TTL plus its retry): a
        # missing key means "dead" only once this grace after a connect is over.
        self.reconnect_grace_s = reconnect_grace_s
        self._connected_at = float("-inf")
        self.on_drop = on_drop
        self.workers: dict[str, WorkerEntry] = {}
        self.redis_ok = False
        self.has_snapshot = False  # a full load succeeded at least once
        self.reconnects = 0

    # -- lifecycle ---------------------------------------------------------------

    async def run(self) -> None:
        """Mirrors Redis until cancelled, surviving Redis outages."""
        backoff = 0.1
        while True:
            client = aioredis.Redis.from_url(
                self.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0
            )
            try:
                await client.ping()
                if not self.redis_ok:
                    logger.info("connected to redis %s", redact(self.redis_url))
                    if self.has_snapshot:
                        self._connected_at = time.monotonic()
                self.redis_ok = True
                backoff = 0.1
                for entry in self.workers.values():
                    entry.loaded = False  # anything may have changed while we were away
                await self.sync_registry(client)
                self.has_snapshot = True
                _raise_if_cancelled()
                await self._follow(client)
            except (RedisError, OSError) as exc:
                if self.redis_ok:
                    logger.warning("redis unavailable (%s); serving from the last mirror", exc)
                self.redis_ok = False
                self.reconnects += 1
            except Exception:
                # A bug must not stop the mirror for good: log it, reconnect, reload.
                logger.exception("index mirror failed; restarting it")
                self.redis_ok = False
                self.reconnects += 1
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
            _raise_if_cancelled()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _follow(self, client: aioredis.Redis) -> None:
        """Polls the registry and tails the streams until either fails.

        Two plain tasks rather than a TaskGroup: on Python 3.11 a TaskGroup whose
        child fails leaves its parent marked as cancelled, which would stop the
        reconnect loop for good.
        """
        tasks = {
            asyncio.create_task(self._poll_loop(client)),
            asyncio.create_task(self._tail_loop(client)),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        for task in done:
            task.result()  # raises the failure that ended the wait

    # -- discovery and load ----------------------------------------------------

    async def _poll_loop(self, client: aioredis.Redis) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.sync_registry(client)
            self.index.prune(time.monotonic())
            _raise_if_cancelled()

    async def sync_registry(self, client: aioredis.Redis) -> None:
        """One discovery pass: registry keys in, dead workers out, new ones loaded."""
        ids = sorted(_text(m) for m in await client.smembers(self.layout.workers))
        async with client.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self.layout.worker(wid))
            raws = await pipe.execute()
        live: set[str] = set()
        for wid, raw in zip(ids, raws, strict=True):
            if not raw:
                continue
            try:
                record = WorkerRecord.from_mapping(raw)
            except ValueError as exc:
                logger.warning("worker %s: ignoring malformed registry record: %s", wid, exc)
                continue
            live.add(wid)
            entry = self.workers.get(wid)
            if entry is None or entry.record.epoch != record.epoch:
                entry = WorkerEntry(record=record, spec=spec_from_record(record))
                self.workers[wid] = entry
                logger.info(
                    "worker %s discovered at %s (epoch %s)", wid, record.address, record.epoch
                )
            else:
                entry.record = record
            if not entry.loaded:
                await self.load_worker(client, wid)
        if time.monotonic() - self._connected_at < self.reconnect_grace_s:
            return  # see reconnect_grace_s: workers may not have re-registered yet
        for wid in [w for w in self.workers if w not in live]:
            self.drop_worker(wid)

    async def load_worker(self, client: aioredis.Redis, worker_id: str) -> None:
        """Replaces ``worker_id``'s blocks with its Redis set; positions its stream tail."""
        entry = self.workers[worker_id]
        async with client.pipeline(transaction=True) as pipe:
            pipe.smembers(self.layout.blocks(worker_id))
            pipe.xrevrange(self.layout.events(worker_id), count=1)
            members, last = await pipe.execute()
        hashes = []
        for m in members:
            try:
                hashes.append(int(m))
            except ValueError:
                logger.warning("worker %s: ignoring non-numeric block %r", worker_id, m)
        self.index.replace(worker_id, hashes)
        entry.stream_id, entry.seq, entry.epoch = "0-0", None, entry.record.epoch
        if last:
            stream_id, fields = last[0]
            entry.stream_id = _text(stream_id)
            batch = self._decode(worker_id, fields)
            if batch is not None:
                entry.seq, entry.epoch = batch.seq, batch.epoch
        entry.loaded = True
        logger.debug(
            "worker %s loaded: %d blocks, stream at %s", worker_id, len(hashes), entry.stream_id
        )

    def drop_worker(self, worker_id: str) -> None:
        """Forgets a dead worker and all its blocks."""
        self.workers.pop(worker_id, None)
        if worker_id in self.index.workers():
            self.index.drop(worker_id)
        logger.info("worker %s gone (registry key expired); dropped from the index", worker_id)
        if self.on_drop is not None:
            self.on_drop(worker_id)

    # -- tail ----------------------------------------------------------------------

    async def _tail_loop(self, client: aioredis.Redis) -> None:
        while True:
            _raise_if_cancelled()
            owners = {self.layout.events(wid): wid for wid, e in self.workers.items() if e.loaded}
            streams: dict[Any, Any] = {
                key: self.workers[wid].stream_id for key, wid in owners.items()
            }
            if not streams:
                await asyncio.sleep(self.poll_s)
                continue
            reply: Any = await client.xread(streams, count=_TAIL_COUNT, block=_TAIL_BLOCK_MS)
            for key, entries in reply or []:
                wid = owners.get(_text(key))
                if wid is None:
                    continue
                await self._apply_entries(client, wid, entries)

    async def _apply_entries(self, client: aioredis.Redis, worker_id: str, entries: list) -> None:
        for raw_id, fields in entries:
            entry = self.workers.get(worker_id)
            if entry is None or not entry.loaded:
                return
            stream_id = _text(raw_id)
            # A reload may have moved past entries this read already fetched.
            if _stream_key(stream_id) <= _stream_key(entry.stream_id):
                continue
            batch = self._decode(worker_id, fields)
            if batch is None:
                entry.stream_id = stream_id
                continue
            gap = entry.seq is not None and batch.seq != entry.seq + 1
            if batch.epoch != entry.epoch or gap:
                logger.info(
                    "worker %s: %s; reloading its block set",
                    worker_id,
                    "new epoch" if batch.epoch != entry.epoch else "event gap",
                )
                await self.load_worker(client, worker_id)
                return
            self._apply(worker_id, batch)
            entry.stream_id, entry.seq = stream_id, batch.seq
            entry.event_lag_s = max(0.0, time.time() - batch.timestamp)

    def _apply(self, worker_id: str, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.add(worker_id, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.remove(worker_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear(worker_id)

    @staticmethod
    def _decode(worker_id: str, fields: dict) -> EventBatch | None:
        data = fields.get(EVENT_FIELD.encode()) or fields.get(EVENT_FIELD)
        if data is None:
            logger.warning("worker %s: stream entry without field %r", worker_id, EVENT_FIELD)
            return None
        try:
            return decode_batch(data if isinstance(data, bytes) else data.encode())
        except ValueError as exc:
            logger.warning("worker %s: %s", worker_id, exc)
            return None
