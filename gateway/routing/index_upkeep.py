"""The block index's upkeep: sweeping dead worker generations, evicting past the bound.

``BlockIndex`` gives a worker a fresh ordinal on every clear or reload, so the
old ordinal's entries are invisible at once and removed here incrementally
(``maintain``, a few shards per call); and with ``max_entries`` set, an insert
into a full shard evicts its least recently looked-up entries (``_evict``).
A mixin over ``BlockIndex``'s tables, kept apart so the index module holds
the entries and the lookups, and this one the background work.
"""

from __future__ import annotations

import time

import numpy as np

from gateway.routing.hash_table import MIN_CAP, SHARDS, SHARED, TOMB, Shard


class IndexUpkeep:
    """Sweeping and eviction over the tables ``BlockIndex`` defines."""

    _shards: list[Shard]
    _names: list[str | None]
    _counts: list[int]
    _free: list[int]
    _dead: set[int]
    _sweeping: set[int]
    _sweep_at: int
    _live_bits: int
    _staging_bits: int
    _entries: int
    _evictions: int
    _tick: int

    def _set_bits(self, shard: Shard, i: int, h: int, bits: int) -> None:
        raise NotImplementedError

    def maintain(self, max_shards: int = 64, budget_s: float = 0.01) -> bool:
        """Sweeps dead ordinals out of up to ``max_shards`` shards; True while work remains.

        Stops early once ``budget_s`` of time is spent (at 10^8 entries a shard
        takes ~2 ms), so a call on the event loop stays short. An ordinal
        becomes reusable once a whole pass has run after its death, so no slot
        can still name it.
        """
        if not self._dead and not self._sweeping:
            return False
        if self._sweep_at == 0 and not self._sweeping:
            self._sweeping = set(self._dead)
        # A lookup table over ordinals, not ``np.isin``: isin sorts on every call, 26 us
        # on a 64-slot shard against 3, and a call sweeps 64 shards on the event loop.
        dead = np.zeros(len(self._names), dtype=bool)
        dead[list(self._sweeping)] = True
        dead_bits = sum(1 << o for o in self._sweeping)
        stop = min(SHARDS, self._sweep_at + max_shards)
        deadline = time.perf_counter() + budget_s
        for s in range(self._sweep_at, stop):
            if s > self._sweep_at and time.perf_counter() > deadline:
                stop = s
                break
            shard = self._shards[s]
            vals = np.asarray(shard.vals)
            hit = (vals >= 0) & dead[np.maximum(vals, 0)]
            n = int(hit.sum())
            if n:
                vals[hit] = TOMB
                shard.live -= n
            for h, bits in list(shard.shared.items()):
                if bits & dead_bits:
                    self._set_bits(shard, shard.find(h), h, bits & ~dead_bits)
            if shard.used > 2 * shard.live + MIN_CAP:
                shard.rebuild(None)
        self._sweep_at = stop
        if stop == SHARDS:
            self._sweep_at = 0
            self._dead -= self._sweeping
            self._free.extend(self._sweeping)
            self._sweeping = set()
        return bool(self._dead or self._sweeping)

    def _dead_array(self) -> np.ndarray | None:
        if not self._dead:
            return None
        return np.fromiter(self._dead, dtype=np.int32, count=len(self._dead))

    def _live_mask(self) -> int:
        return self._live_bits

    def _evict(self, shard: Shard) -> None:
        """Drops the least recently looked-up eighth of ``shard``'s entries."""
        vals = np.asarray(shard.vals)
        if shard.ticks is None:
            return
        ticks = np.asarray(shard.ticks)
        slots = np.flatnonzero((vals >= 0) | (vals == SHARED))
        if not slots.size:
            return
        n = max(1, slots.size // 8)
        # Ages relative to now survive the u32 tick wrapping.
        age = (np.uint32(self._tick) - ticks[slots]).astype(np.uint32)
        victims = slots[np.argpartition(-age.astype(np.int64), n - 1)[:n]]
        keys = np.asarray(shard.keys)
        gone = 0
        for i in victims.tolist():
            v = int(vals[i])
            if v >= 0:
                if self._names[v] is not None:
                    self._counts[v] -= 1
                    gone += 1
            else:
                h = int(keys[i])
                bits = shard.shared.pop(h) & (self._live_mask() | self._staging_bits)
                while bits:
                    low = bits & -bits
                    o = low.bit_length() - 1
                    if self._names[o] is not None:
                        self._counts[o] -= 1
                        gone += 1
                    bits ^= low
            vals[i] = TOMB
        shard.live -= len(victims)
        self._entries -= gone
        self._evictions += gone
