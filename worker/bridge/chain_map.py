"""Translates an engine's block events into kvroute's own chain hashes.

The engine's hashes are never trusted as kvroute hashes (vLLM's are sha256
chains under its own seed). For every stored block the bridge recomputes
``contract.hashing.block_hash(parent, tokens, spec)`` where the parent is the
kvroute hash it computed for the engine's parent block (``spec.seed`` for
block 0, with the event's LoRA and cache salt). The map engine-hash ->
kvroute-hash finds parents and translates removals.

vLLM announces each *physical copy* of a block (a prompt that only partly hit
recomputes its last block into a second copy with the same hash) and removes
each copy on eviction, so the map counts copies; a kvroute hash leaves the set
when its last copy is gone. A block whose parent the bridge never saw (it
joined late, or missed events) is an orphan: it cannot be chained, and no
gateway could reach it from block 0 anyway, so it is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from contract.hashing import HashSpec, block_hash
from worker.bridge.engine_events import (
    ClearedBlocks,
    EngineEvent,
    EngineHash,
    RemovedBlocks,
    StoredBlocks,
)

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    kvroute_hash: int
    copies: int


class ChainMap:
    """One engine worker's blocks: engine hash -> (kvroute hash, physical copies)."""

    def __init__(self, spec: HashSpec) -> None:
        self.spec = spec  # block size, model, revision; LoRA and salt come per event
        self._entries: dict[EngineHash, _Entry] = {}
        self._resident: dict[int, int] = {}  # kvroute hash -> engine blocks that map to it
        self.orphans = 0  # stored blocks skipped because their parent was unknown
        self.mismatched = 0  # stored events skipped for a block size other than the spec's

    def __len__(self) -> int:
        return len(self._resident)

    def resident_block_hashes(self) -> set[int]:
        """The kvroute hashes of every block the engine holds (as far as the bridge saw)."""
        return set(self._resident)

    def kvroute_hash(self, engine_hash: EngineHash) -> int | None:
        entry = self._entries.get(engine_hash)
        return entry.kvroute_hash if entry is not None else None

    def clear(self) -> None:
        """Forgets everything (a new epoch)."""
        self._entries.clear()
        self._resident.clear()

    def apply(self, events: Iterable[EngineEvent]) -> list[KVEvent]:
        """Applies engine events; returns the kvroute events they amount to, in order."""
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, StoredBlocks):
                stored = self._store(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, RemovedBlocks):
                removed = self._remove(event.block_hashes)
                if removed:
                    out.append(BlockRemoved(tuple(removed)))
            elif isinstance(event, ClearedBlocks):
                self.clear()
                out.append(AllBlocksCleared())
        return out

    def _store(self, event: StoredBlocks) -> BlockStored | None:
        bs = self.spec.block_size
        n = len(event.block_hashes)
        if event.block_size != bs or len(event.token_ids) != n * bs:
            self.mismatched += 1
            logger.warning(
                "skipping a stored event of %d blocks: block size %d, %d tokens (expected %d per block)",
                n,
                event.block_size,
                len(event.token_ids),
                bs,
            )
            return None
        if event.parent_hash is None:
            spec = self.spec.with_lora(event.lora_name).with_salt(event.cache_salt)
            parent_k: int | None = None
            parent = spec.seed
        else:
            entry = self._entries.get(event.parent_hash)
            if entry is None:
                self.orphans += n
                return None
            parent_k = parent = entry.kvroute_hash
        hashes: list[int] = []
        for i, engine_hash in enumerate(event.block_hashes):
            parent = block_hash(parent, event.token_ids[i * bs : (i + 1) * bs], self.spec)
            hashes.append(parent)
            entry = self._entries.get(engine_hash)
            if entry is None:
                self._entries[engine_hash] = _Entry(parent, 1)
                self._resident[parent] = self._resident.get(parent, 0) + 1
            else:
                entry.copies += 1
        return BlockStored(tuple(hashes), parent_k)

    def _remove(self, engine_hashes: Iterable[EngineHash]) -> list[int]:
        removed: list[int] = []
        for engine_hash in engine_hashes:
            entry = self._entries.get(engine_hash)
            if entry is None:
                continue  # an orphan, or a block from before the bridge joined
            entry.copies -= 1
            if entry.copies > 0:
                continue
            del self._entries[engine_hash]
            left = self._resident.get(entry.kvroute_hash, 0) - 1
            if left > 0:
                self._resident[entry.kvroute_hash] = left
            else:
                self._resident.pop(entry.kvroute_hash, None)
                removed.append(entry.kvroute_hash)
        return removed
