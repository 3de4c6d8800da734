"""The index mirror's discovery duty: Redis's worker registry in, dead workers out.

One pass (``RegistrySync.sync_registry``) reads the directory and every
registry hash in one pipelined round trip. A known worker is read with
``HMGET`` of the load fields only; a new worker, or a new epoch, with a full
``HGETALL``, and is queued for a block-set load. A worker that tokenizes
differently from this gateway is refused. A missing key is a dead worker,
except within the reconnect grace and while ``FleetLossHold`` keeps a fleet
that vanished all at once (``gateway.routing.mirror_fleet_loss``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from contract.hashing import HASH_VERSION, HashSpec
from contract.redis_layout import WorkerRecord, valid_worker_id
from gateway.routing.mirror_state import MirrorState, WorkerEntry, as_text

# The mirror's log: its lines keep the one logger name whichever module writes them.
logger = logging.getLogger("gateway.routing.mirror")

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
# A new heartbeat is told by its ``updated_at``. (It was told by the last field, which
# ``engine_step_age_s`` became: a bridged vLLM worker always reports 0 there, and the
# gateway then never saw its load change after discovery.)
_STAMP = _LOAD_FIELDS.index("updated_at")


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


def _load_update(record: WorkerRecord, values: list[Any]) -> WorkerRecord:
    """``record`` with the heartbeat's load fields from an ``HMGET`` of ``_LOAD_FIELDS``."""
    changes: dict[str, Any] = {}
    for name, raw in zip(_LOAD_FIELDS[1:], values[1:], strict=True):
        if raw is None:
            continue
        text = as_text(raw)
        changes[name] = float(text) if name.endswith(("_per_s", "_at", "_s")) else int(text)
    return replace(record, **changes)


class RegistrySync(MirrorState):
    """Discovery: keeps ``workers`` equal to the live registry records."""

    async def sync_registry(self, client: Any) -> None:
        """One discovery pass: registry keys in, dead workers out, new ones queued.

        Known workers are read with ``HMGET`` of the load fields only (one
        pipelined round trip for the fleet); a full ``HGETALL`` only for a
        worker that is new or whose epoch changed.
        """
        ids = sorted(
            w
            for w in (as_text(m) for m in await client.smembers(self.layout.workers))
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
                if as_text(raw[0]) == entry.record.epoch:
                    if raw[_STAMP] != entry.heartbeat:  # a poll between heartbeats parses nothing
                        try:
                            entry.record = _load_update(entry.record, raw)
                            entry.heartbeat = raw[_STAMP]
                            self.changes += 1
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
        held = self.fleet_loss.held(missing, live, set(ids))
        for wid in missing:
            if wid not in held:
                self.drop_worker(wid)

    def _discover(self, wid: str, raw: Any) -> None:
        try:
            record = WorkerRecord.from_mapping(raw)
        except ValueError as exc:
            logger.warning("worker %s: ignoring malformed registry record: %s", wid, exc)
            return
        if not self._same_tokenizer(wid, record):
            return
        entry = self.workers.get(wid)
        self.changes += 1
        if entry is None or entry.record.epoch != record.epoch:
            self.workers[wid] = WorkerEntry(record=record, spec=spec_from_record(record))
            logger.info("worker %s discovered at %s (epoch %s)", wid, record.address, record.epoch)
            self._queue_load(wid)
            if self.on_discover is not None:
                self.on_discover(wid, record)
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
