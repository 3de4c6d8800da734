"""Keeps the gateway's ``BlockIndex`` and worker list in step with Redis.

Four duties, all on the event loop, none of which waits on another:

1. Discovery: every ``poll_s`` read the directory and every registry hash in
   one pipelined round trip. A missing key is a dead worker: it and all its
   blocks leave the index. A new worker (or a new epoch) is queued for a load.
2. Load (its own task): for up to ``_LOAD_BATCH`` queued workers per round
   trip, read each stream's last entry and *then* its block set. Events are
   idempotent set operations, so replaying the stream from that entry onto a
   set that may already include later events converges to the same set. The
   set is staged into the index in slices between awaits and swapped in at
   once (``BlockIndex.stage``): a 100k-block reload never stalls the loop,
   and lookups keep the old blocks until the new ones are complete.
3. Tail: ``XREAD BLOCK`` every loaded worker's stream from its last id and
   apply the batches. A new epoch or a ``seq`` gap queues that worker for a
   reload; the others' tail goes on.
4. Upkeep: expire speculative entries, sweep cleared workers' old entries.

When Redis goes away the last mirror stays (routing keeps working on it). The
same holds when Redis answers but every worker's registry key vanished at once
while the directory still lists them: one worker dying looks like that, a whole
fleet dying in the same poll looks like Redis trouble (a full ``noeviction``
Redis refusing every heartbeat's ``HSET`` until the TTLs run out). The mirror
keeps that last fleet for ``fleet_loss_grace_s``, logs it once and shows it in
``kvroute_gateway_registry_held_workers`` and
``kvroute_gateway_registry_fleet_vanished_total``; a worker that deregistered
(left the directory) is dropped at once all the same. On
reconnect nothing is reloaded blindly: one pipelined read of every stream's
last id tells which workers' streams went back (a Redis that lost its data);
only those reload, the others resume their tail and their ``seq`` decides.

On Redis Cluster (``cluster=True``) streams live in different slots, so the
tail becomes a pipelined non-blocking ``XREAD`` per worker every
``_CLUSTER_TAIL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from contract.hashing import HASH_VERSION, HashSpec
from contract.redis_layout import (
    EVENT_FIELD,
    RedisLayout,
    WorkerRecord,
    decode_block_set,
    valid_worker_id,
)
from contract.redis_url import redact
from gateway.routing.index import BlockIndex, StagedSet

logger = logging.getLogger(__name__)

_TAIL_BLOCK_MS = 250  # short, so newly loaded workers join the XREAD quickly
_TAIL_COUNT = 1000
_MAX_BACKOFF_S = 5.0
_UNREACHABLE_LOG_S = 3.0  # at most one "cannot reach redis" line per this many seconds
_LOAD_BATCH = 16  # workers read per round trip when loading
_LOAD_SLICE = 4096  # hashes staged into the index between yields (~5 ms)
_CLUSTER_TAIL_S = 0.05
_PRUNE_SLICE = 20_000  # speculative entries expired between yields (~8 ms)
# A vanished fleet is kept this long: several heartbeat TTLs (default 3 s), long
# enough for a Redis that refused writes for a moment to take them again, short
# enough that a fleet that really died stops being routed to soon.
FLEET_LOSS_GRACE_S = 15.0
# Registry fields that change with every heartbeat; the rest only with an epoch.
_LOAD_FIELDS = (
    "epoch",
    "running",
    "waiting",
    "queued_prefill_tokens",
    "free_blocks",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "updated_at",
    "engine_step_age_s",  # a stuck engine behind a live heartbeat
)


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
    loads: int = 0  # completed loads of this worker's set (tests, logs)
    heartbeat: Any = None  # the raw ``updated_at`` last parsed (unchanged: skip the parse)


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


def _load_update(record: WorkerRecord, values: list[Any]) -> WorkerRecord:
    """``record`` with the heartbeat's load fields from an ``HMGET`` of ``_LOAD_FIELDS``."""
    changes: dict[str, Any] = {}
    for name, raw in zip(_LOAD_FIELDS[1:], values[1:], strict=True):
        if raw is None:
            continue
        text = _text(raw)
        changes[name] = float(text) if name.endswith(("_per_s", "_at", "_s")) else int(text)
    return replace(record, **changes)


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
        cluster: bool = False,
        tokenizer_fingerprint: str = "",
        fleet_loss_grace_s: float = FLEET_LOSS_GRACE_S,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.layout = layout
        self.index = index
        self.poll_s = poll_s
        self.cluster = cluster
        # A worker whose record names another tokenizer is never routed to ("" checks nothing).
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.refused: dict[str, str] = {}  # worker id -> epoch refused for its tokenizer
        # A Redis that just came back may be empty until every worker's
        # publisher re-registers (up to a heartbeat TTL plus its retry): a
        # missing key means "dead" only once this grace after a connect is over.
        self.reconnect_grace_s = reconnect_grace_s
        self._connected_at = float("-inf")
        # Every listed worker's key gone in one poll: Redis trouble, not deaths (module doc).
        self.fleet_loss_grace_s = fleet_loss_grace_s
        self._fleet_lost_at: float | None = None  # when the held fleet vanished
        registry = registry if registry is not None else CollectorRegistry()
        self.fleet_vanished = Counter(
            "kvroute_gateway_registry_fleet_vanished",
            "Times every worker's registry key vanished at once (kept as Redis trouble)",
            registry=registry,
        )
        self.held_workers = Gauge(
            "kvroute_gateway_registry_held_workers",
            "Workers kept in routing although their registry key vanished (Redis trouble)",
            registry=registry,
        )
        self.on_drop = on_drop
        self.workers: dict[str, WorkerEntry] = {}
        self.redis_ok = False
        self.has_snapshot = False  # a full load succeeded at least once
        self.reconnects = 0
        self.last_error = ""  # why Redis was last unreachable, for logs and 503 bodies
        self._next_unreachable_log = 0.0
        self.reloads = 0  # loads of a worker that was already loaded once (gaps, epochs)
        self._pending: dict[str, None] = {}  # workers queued for a load, in order
        self._wake_loader = asyncio.Event()
        self._staged: dict[str, StagedSet] = {}

    def _client(self) -> Any:
        opts: dict[str, Any] = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}
        if self.cluster:
            return RedisCluster.from_url(self.redis_url, **opts)
        return aioredis.Redis.from_url(self.redis_url, **opts)

    # -- lifecycle ---------------------------------------------------------------

    def no_worker_hint(self) -> str:
        """Why there may be no worker to route to, in words for a 503 body."""
        url = redact(self.redis_url)
        if not self.redis_ok and not self.has_snapshot:
            return f"this gateway cannot reach Redis at {url} ({self.last_error}); retrying"
        if not self.redis_ok:
            return f"Redis at {url} is unreachable ({self.last_error}); retrying"
        return (
            f"no worker is registered in Redis {url} under namespace "
            f"'{self.layout.namespace}' (workers need the same --redis-url and --redis-namespace)"
        )

    async def run(self) -> None:
        """Mirrors Redis until cancelled, surviving Redis outages."""
        backoff = 0.1
        while True:
            client = self._client()
            try:
                await client.ping()
                if not self.redis_ok:
                    logger.info("connected to redis %s", redact(self.redis_url))
                    if self.has_snapshot:
                        self._connected_at = time.monotonic()
                self.redis_ok = True
                backoff = 0.1
                if self.has_snapshot:
                    await self.revalidate(client)
                await self.sync_registry(client)
                await self.load_pending(client)
                self.has_snapshot = True
                _raise_if_cancelled()
                await self._follow(client)
            except (RedisError, OSError) as exc:
                self.last_error = str(exc) or type(exc).__name__
                if self.redis_ok:
                    logger.warning("redis unavailable (%s); serving from the last mirror", exc)
                elif time.monotonic() >= self._next_unreachable_log:
                    # Never reached (or still down): a line every few seconds, not silence.
                    logger.warning(
                        "cannot reach redis %s (%s); retrying", redact(self.redis_url), exc
                    )
                    self._next_unreachable_log = time.monotonic() + _UNREACHABLE_LOG_S
                self.redis_ok = False
                self.reconnects += 1
            except Exception:
                # A bug must not stop the mirror for good: log it, reconnect, reload.
                logger.exception("index mirror failed; restarting it")
                self.redis_ok = False
                self.reconnects += 1
                for wid in self.workers:
                    self._queue_load(wid)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
            _raise_if_cancelled()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _follow(self, client: Any) -> None:
        """Polls the registry, loads and tails until one of them fails.

        Plain tasks rather than a TaskGroup: on Python 3.11 a TaskGroup whose
        child fails leaves its parent marked as cancelled, which would stop the
        reconnect loop for good.
        """
        tail = self._cluster_tail_loop if self.cluster else self._tail_loop
        tasks = {
            asyncio.create_task(self._poll_loop(client)),
            asyncio.create_task(self._load_loop(client)),
            asyncio.create_task(tail(client)),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        for task in done:
            task.result()  # raises the failure that ended the wait

    # -- discovery ---------------------------------------------------------------

    async def _poll_loop(self, client: Any) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.sync_registry(client)
            now = time.monotonic()
            while self.index.prune(now, limit=_PRUNE_SLICE) >= _PRUNE_SLICE:
                await asyncio.sleep(0)  # 1M expiring entries would hold the loop ~0.4 s
            self.index.maintain()
            _raise_if_cancelled()

    async def sync_registry(self, client: Any) -> None:
        """One discovery pass: registry keys in, dead workers out, new ones queued.

        Known workers are read with ``HMGET`` of the load fields only (one
        pipelined round trip for the fleet); a full ``HGETALL`` only for a
        worker that is new or whose epoch changed.
        """
        ids = sorted(
            w
            for w in (_text(m) for m in await client.smembers(self.layout.workers))
            if valid_worker_id(w)
        )
        async with client.pipeline(transaction=False) as pipe:
            for wid in ids:
                if wid in self.workers:
                    pipe.hmget(self.layout.worker(wid), _LOAD_FIELDS)
                else:
                    pipe.hgetall(self.layout.worker(wid))
            raws = await pipe.execute()
        live: set[str] = set()
        fresh: list[str] = []
        for wid, raw in zip(ids, raws, strict=True):
            entry = self.workers.get(wid)
            if entry is not None and isinstance(raw, list):
                if raw[0] is None:
                    continue  # the key expired
                if _text(raw[0]) == entry.record.epoch:
                    if raw[-1] != entry.heartbeat:  # a poll between heartbeats parses nothing
                        try:
                            entry.record = _load_update(entry.record, raw)
                            entry.heartbeat = raw[-1]
                        except ValueError as exc:
                            logger.warning("worker %s: malformed load fields: %s", wid, exc)
                    live.add(wid)
                    continue
                fresh.append(wid)  # a new epoch: read the whole record below
                live.add(wid)
                continue
            if not raw:
                continue
            live.add(wid)
            self._discover(wid, raw)
        if fresh:
            async with client.pipeline(transaction=False) as pipe:
                for wid in fresh:
                    pipe.hgetall(self.layout.worker(wid))
                for wid, raw in zip(fresh, await pipe.execute(), strict=True):
                    if raw:
                        self._discover(wid, raw)
                    else:
                        live.discard(wid)
        if time.monotonic() - self._connected_at < self.reconnect_grace_s:
            return  # see reconnect_grace_s: workers may not have re-registered yet
        missing = [w for w in self.workers if w not in live]
        held = self._held(missing, live, set(ids))
        for wid in missing:
            if wid not in held:
                self.drop_worker(wid)

    def _held(self, missing: list[str], live: set[str], listed: set[str]) -> set[str]:
        """The workers whose key is missing but that stay, as part of a vanished fleet.

        Holding starts when two or more workers, all still in the directory, lose
        their keys in the same poll with none left live (one key expiring is that
        worker's death); it ends when any worker is live again, when they leave
        the directory (deregistered) or after ``fleet_loss_grace_s``.
        """
        vanished = {w for w in missing if w in listed}
        if live or not vanished:
            self._end_hold("a worker is live again" if live else "the workers deregistered")
            return set()
        now = time.monotonic()
        if self._fleet_lost_at is None:
            if len(vanished) < 2 or len(vanished) != len(missing):
                return set()
            self._fleet_lost_at = now
            self.fleet_vanished.inc()
            logger.warning(
                "every worker's registry key vanished at once (%d workers): treating it as "
                "Redis trouble (full or flushed?) and keeping the last known fleet for %.0f s",
                len(vanished),
                self.fleet_loss_grace_s,
            )
        elif now - self._fleet_lost_at >= self.fleet_loss_grace_s:
            self._end_hold(f"no registry key came back within {self.fleet_loss_grace_s:.0f} s")
            return set()
        self.held_workers.set(len(vanished))
        return vanished

    def _end_hold(self, why: str) -> None:
        if self._fleet_lost_at is None:
            return
        self._fleet_lost_at = None
        self.held_workers.set(0)
        logger.warning("registry: no longer holding the vanished fleet (%s)", why)

    def _discover(self, wid: str, raw: Any) -> None:
        try:
            record = WorkerRecord.from_mapping(raw)
        except ValueError as exc:
            logger.warning("worker %s: ignoring malformed registry record: %s", wid, exc)
            return
        if not self._same_tokenizer(wid, record):
            return
        entry = self.workers.get(wid)
        if entry is None or entry.record.epoch != record.epoch:
            self.workers[wid] = WorkerEntry(record=record, spec=spec_from_record(record))
            logger.info("worker %s discovered at %s (epoch %s)", wid, record.address, record.epoch)
            self._queue_load(wid)
        else:
            entry.record = record

    def _same_tokenizer(self, wid: str, record: WorkerRecord) -> bool:
        ours, theirs = self.tokenizer_fingerprint, record.tokenizer_fingerprint
        if not ours or not theirs or ours == theirs:
            self.refused.pop(wid, None)
            return True
        if self.refused.get(wid) != record.epoch:
            self.refused[wid] = record.epoch
            logger.error(
                "worker %s at %s tokenizes differently (fingerprint %s, this gateway %s): "
                "not routing to it",
                wid,
                record.address,
                theirs,
                ours,
            )
        if wid in self.workers:
            self.drop_worker(wid)
        return False

    def _queue_load(self, wid: str) -> None:
        entry = self.workers.get(wid)
        if entry is not None:
            entry.loaded = False  # the tail skips it until the load has positioned it
        self._pending[wid] = None
        self._wake_loader.set()

    # -- load ----------------------------------------------------------------------

    async def _load_loop(self, client: Any) -> None:
        while True:
            await self._wake_loader.wait()
            self._wake_loader.clear()
            await self.load_pending(client)
            _raise_if_cancelled()

    async def load_pending(self, client: Any) -> None:
        """Loads every queued worker, ``_LOAD_BATCH`` per round trip."""
        while self._pending:
            batch = list(self._pending)[:_LOAD_BATCH]
            for wid in batch:
                del self._pending[wid]
            await self._load(client, [w for w in batch if w in self.workers])

    async def load_worker(self, client: Any, worker_id: str) -> None:
        """Replaces ``worker_id``'s blocks with its Redis set; positions its stream tail."""
        self._pending.pop(worker_id, None)
        await self._load(client, [worker_id])

    async def _load(self, client: Any, wids: list[str]) -> None:
        if not wids:
            return
        async with client.pipeline(transaction=False) as pipe:
            for wid in wids:
                pipe.xrevrange(self.layout.events(wid), count=1)  # position first, then set
                pipe.hvals(self.layout.blocks(wid))
            replies = await pipe.execute()
        for n, wid in enumerate(wids):
            last, values = replies[2 * n], replies[2 * n + 1]
            entry = self.workers.get(wid)
            if entry is None:
                continue
            hashes = decode_block_set(values)
            old = self._staged.pop(wid, None)
            if old is not None:
                old.abort()
            staged = self.index.stage(wid)
            self._staged[wid] = staged
            for i in range(0, len(hashes), _LOAD_SLICE):
                staged.add(hashes[i : i + _LOAD_SLICE])
                if len(hashes) > _LOAD_SLICE:
                    await asyncio.sleep(0)
            if self.workers.get(wid) is not entry or self._staged.get(wid) is not staged:
                staged.abort()  # dropped, re-discovered or re-queued meanwhile
                continue
            del self._staged[wid]
            staged.commit()
            entry.stream_id, entry.seq, entry.epoch = "0-0", None, entry.record.epoch
            if last:
                stream_id, fields = last[0]
                entry.stream_id = _text(stream_id)
                batch = self._decode(wid, fields)
                if batch is not None:
                    entry.seq, entry.epoch = batch.seq, batch.epoch
            if entry.loads:
                self.reloads += 1
            entry.loads += 1
            entry.loaded = wid not in self._pending
            logger.debug(
                "worker %s loaded: %d blocks, stream at %s", wid, len(hashes), entry.stream_id
            )

    async def revalidate(self, client: Any) -> None:
        """After a reconnect: reload only the workers whose stream went back.

        A stream whose last id is before ours was re-created (Redis lost its
        data); anything else resumes its tail, where ``seq`` catches gaps.
        """
        wids = [w for w, e in self.workers.items() if e.loaded]
        async with client.pipeline(transaction=False) as pipe:
            for wid in wids:
                pipe.xrevrange(self.layout.events(wid), count=1)
            replies = await pipe.execute()
        for wid, last in zip(wids, replies, strict=True):
            # A stream that is gone will be re-created by its publisher's re-sync
            # (a snapshot batch the tail applies, or whose seq forces a reload).
            if last and _stream_key(_text(last[0][0])) < _stream_key(self.workers[wid].stream_id):
                self._queue_load(wid)

    def drop_worker(self, worker_id: str) -> None:
        """Forgets a dead worker and all its blocks."""
        self.workers.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        staged = self._staged.pop(worker_id, None)
        if staged is not None:
            staged.abort()
        if worker_id in self.index.workers():
            self.index.drop(worker_id)
        logger.info("worker %s gone (registry key expired); dropped from the index", worker_id)
        if self.on_drop is not None:
            self.on_drop(worker_id)

    # -- tail ----------------------------------------------------------------------

    async def _tail_loop(self, client: Any) -> None:
        while True:
            _raise_if_cancelled()
            owners = {self.layout.events(wid): wid for wid, e in self.workers.items() if e.loaded}
            streams: dict[Any, Any] = {
                key: self.workers[wid].stream_id for key, wid in owners.items()
            }
            if not streams:
                await asyncio.sleep(min(self.poll_s, 0.05))
                continue
            reply: Any = await client.xread(streams, count=_TAIL_COUNT, block=_TAIL_BLOCK_MS)
            for key, entries in reply or []:
                wid = owners.get(_text(key))
                if wid is not None:
                    self._apply_entries(wid, entries)

    async def _cluster_tail_loop(self, client: Any) -> None:
        """Cluster: one non-blocking XREAD per stream, pipelined (slots differ)."""
        while True:
            _raise_if_cancelled()
            wids = [wid for wid, e in self.workers.items() if e.loaded]
            if wids:
                async with client.pipeline(transaction=False) as pipe:
                    for wid in wids:
                        key = self.layout.events(wid)
                        pipe.xread({key: self.workers[wid].stream_id}, count=_TAIL_COUNT)
                    replies = await pipe.execute()
                for wid, reply in zip(wids, replies, strict=True):
                    for _, entries in reply or []:
                        self._apply_entries(wid, entries)
            await asyncio.sleep(_CLUSTER_TAIL_S)

    def _apply_entries(self, worker_id: str, entries: list) -> None:
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
                self._queue_load(worker_id)
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
