"""The index mirror's stream duties: each worker's block set loaded, its event stream tailed.

Load (``StreamSync.load_pending``): for up to ``_LOAD_BATCH`` queued workers
per round trip, read each stream's last entry and *then* its block set. Events
are idempotent set operations, so replaying the stream from that entry onto a
set that may already include later events converges to the same set. The set
is staged into the index in slices between awaits and swapped in at once
(``BlockIndex.stage``): a 100k-block reload never stalls the loop, and lookups
keep the old blocks until the new ones are complete.

Tail: ``XREAD BLOCK`` every loaded worker's stream from its last id and apply
the batches. A new epoch or a ``seq`` gap queues that worker for a reload; the
others' tail goes on. On Redis Cluster streams live in different slots, so the
tail is a pipelined non-blocking ``XREAD`` per worker every ``_CLUSTER_TAIL_S``.
After a reconnect ``revalidate`` reloads only the workers whose stream went back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from contract.redis_layout import EVENT_FIELD, decode_block_set
from gateway.routing.mirror_state import MirrorState, as_text, raise_if_cancelled

# The mirror's log: its lines keep the one logger name whichever module writes them.
logger = logging.getLogger("gateway.routing.mirror")

_TAIL_BLOCK_MS = 250  # short, so newly loaded workers join the XREAD quickly
_TAIL_COUNT = 1000
_LOAD_BATCH = 16  # workers read per round trip when loading
_LOAD_SLICE = 4096  # hashes staged into the index between yields (~5 ms)
_CLUSTER_TAIL_S = 0.05


def _stream_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class StreamSync(MirrorState):
    """Loads queued workers' block sets into the index and applies their event streams."""

    # -- load ----------------------------------------------------------------------

    async def _load_loop(self, client: Any) -> None:
        while True:
            await self._wake_loader.wait()
            self._wake_loader.clear()
            await self.load_pending(client)
            raise_if_cancelled()

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
                entry.stream_id = as_text(stream_id)
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
            if last and _stream_key(as_text(last[0][0])) < _stream_key(self.workers[wid].stream_id):
                self._queue_load(wid)

    # -- tail ----------------------------------------------------------------------

    async def _tail_loop(self, client: Any) -> None:
        while True:
            raise_if_cancelled()
            owners = {self.layout.events(wid): wid for wid, e in self.workers.items() if e.loaded}
            streams: dict[Any, Any] = {
                key: self.workers[wid].stream_id for key, wid in owners.items()
            }
            if not streams:
                await asyncio.sleep(min(self.poll_s, 0.05))
                continue
            reply: Any = await client.xread(streams, count=_TAIL_COUNT, block=_TAIL_BLOCK_MS)
            for key, entries in reply or []:
                wid = owners.get(as_text(key))
                if wid is not None:
                    self._apply_entries(wid, entries)

    async def _cluster_tail_loop(self, client: Any) -> None:
        """Cluster: one non-blocking XREAD per stream, pipelined (slots differ)."""
        while True:
            raise_if_cancelled()
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
            stream_id = as_text(raw_id)
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
