"""The block index's hash table: one open-addressing shard of flat numpy arrays.

Keys are block hashes (u64); a slot's holder is a worker ordinal (>= 0) or one
of the markers below; with a memory bound each slot also keeps the tick of
its last lookup. ``gateway.routing.index`` splits hashes over ``SHARDS`` of
these by the hash's low bits and owns everything else (ordinals, shared
bitsets' meaning, speculation, eviction policy).
"""

from __future__ import annotations

import numpy as np

SHARD_BITS = 10
SHARDS = 1 << SHARD_BITS
SHARD_MASK = SHARDS - 1
EMPTY = -1  # holder value of a never-used slot (ends a probe)
TOMB = -2  # holder value of a deleted slot (a probe walks past it)
SHARED = -3  # holders are in the shard's ``shared`` dict as a bitset
MAX_LOAD = 0.7  # used slots (live + tombstones) per slot before a rebuild
MIN_CAP = 64  # 1024 shards x 64 slots x 16 B: 1 MB before the first entry


class Shard:
    """One open-addressing table: key, holder and (with a memory bound) last-use tick per slot."""

    __slots__ = ("cap", "keys", "live", "mask", "recent", "shared", "ticks", "used", "vals")

    def __init__(self, ticks: bool, cap: int = MIN_CAP) -> None:
        self.cap = cap
        self.mask = cap - 1
        self.keys = np.zeros(cap, dtype=np.uint64).data
        self.vals = np.full(cap, EMPTY, dtype=np.int32).data
        # Ticks only matter to eviction: an unbounded index saves 4 bytes a slot.
        self.ticks = np.zeros(cap, dtype=np.uint32).data if ticks else None
        self.used = 0  # slots not EMPTY
        self.live = 0  # slots holding a key (not EMPTY, not TOMB)
        self.shared: dict[int, int] = {}
        # Holders of this shard's recently looked-up hashes (``BlockIndex.longest_prefix``).
        self.recent: dict[int, int] = {}

    def find(self, h: int) -> int:
        """Slot of ``h``, or -1."""
        keys, vals, mask = self.keys, self.vals, self.mask
        i = (h >> SHARD_BITS) & mask
        while True:
            v = vals[i]
            if v == EMPTY:
                return -1
            if v != TOMB and keys[i] == h:
                return i
            i = (i + 1) & mask

    def find_or_slot(self, h: int) -> tuple[int, bool]:
        """(slot, found): the slot of ``h``, or where to insert it."""
        keys, vals, mask = self.keys, self.vals, self.mask
        i = (h >> SHARD_BITS) & mask
        free = -1
        while True:
            v = vals[i]
            if v == EMPTY:
                return (i if free < 0 else free), False
            if v == TOMB:
                if free < 0:
                    free = i
            elif keys[i] == h:
                return i, True
            i = (i + 1) & mask

    def rebuild(self, dead: np.ndarray | None) -> None:
        """Re-hashes live slots into a table sized for them (dead ordinals dropped)."""
        keys = np.asarray(self.keys)
        vals = np.asarray(self.vals)
        keep = (vals >= 0) | (vals == SHARED)
        if dead is not None and dead.size:
            keep &= ~np.isin(vals, dead)
        k, v = keys[keep], vals[keep]
        t = np.asarray(self.ticks)[keep] if self.ticks is not None else None
        cap = MIN_CAP
        # Small shards grow 4x at a time: a numpy rebuild has a fixed cost.
        need = len(k) * (3 if len(k) < 1024 else 1)
        while cap * 0.4 < need:
            cap *= 2
        new_keys = np.zeros(cap, dtype=np.uint64)
        new_vals = np.full(cap, EMPTY, dtype=np.int32)
        new_ticks = np.zeros(cap, dtype=np.uint32) if t is not None else None
        mask = np.uint64(cap - 1)
        pos = ((k >> np.uint64(SHARD_BITS)) & mask).astype(np.int64)
        pending = np.arange(len(k))
        while pending.size:
            p = pos[pending]
            free = new_vals[p] == EMPTY
            cand, cp = pending[free], p[free]
            _, first = np.unique(cp, return_index=True)
            win = cand[first]
            new_keys[pos[win]] = k[win]
            new_vals[pos[win]] = v[win]
            if new_ticks is not None and t is not None:
                new_ticks[pos[win]] = t[win]
            lost = np.ones(len(pending), dtype=bool)
            lost[np.flatnonzero(free)[first]] = False
            pending = pending[lost]
            pos[pending] = (pos[pending] + 1) & (cap - 1)
        self.cap, self.mask = cap, cap - 1
        self.keys = new_keys.data
        self.vals = new_vals.data
        self.ticks = new_ticks.data if new_ticks is not None else None
        self.used = self.live = len(k)

    def nbytes(self) -> int:
        return self.cap * (16 if self.ticks is not None else 12)
