"""A simulated worker's prefix cache: a fixed number of blocks, LRU eviction, pinning.

It mirrors the engine's ``BlockPool`` at the level the router cares about:

- a request's prompt is a chain of block hashes; its hit is the longest run of
  the chain present from block 0 (a hole ends the hit, as in the engine);
- blocks of running requests are pinned (reference counted) and never evicted;
- a finished request's blocks are freed tail-first, so the LRU end of the free
  list holds the chain's leaves and a shared prefix outlives its branches;
- new blocks evict the least recently freed blocks when the cache is full.

The only difference from the engine: if every block is pinned the cache runs
over capacity instead of making the request wait (counted in ``overflow_peak``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class BlockCache:
    """Block hashes a worker holds, in LRU order, with pins for running requests."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("--capacity-tokens must hold at least one block")
        self.capacity = capacity_blocks
        self._free: OrderedDict[Hashable, None] = OrderedDict()  # unpinned, LRU first
        self._pins: dict[Hashable, int] = {}  # pinned block -> reference count
        self.evictions = 0
        self.overflow_peak = 0  # most blocks ever held above capacity

    def __len__(self) -> int:
        return len(self._free) + len(self._pins)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pins or key in self._free

    @property
    def pinned(self) -> int:
        return len(self._pins)

    @property
    def free_blocks(self) -> int:
        """Blocks not pinned by a running request (cached-but-idle blocks count as free)."""
        return max(self.capacity - len(self._pins), 0)

    def match(self, keys: Sequence[Hashable]) -> int:
        """Number of leading blocks of ``keys`` held now."""
        n = 0
        for key in keys:
            if key not in self._pins and key not in self._free:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[Hashable]) -> tuple[int, list[Hashable], list[Hashable]]:
        """Pin the whole chain ``keys`` for a starting request.

        Returns ``(hit_blocks, stored, evicted)``: the leading run that was
        already held, the blocks newly added, and the blocks evicted to make
        room for them, in eviction order.
        """
        hit = self.match(keys)
        stored: list[Hashable] = []
        for key in keys:
            if key in self._pins:
                self._pins[key] += 1
                continue
            if key in self._free:
                del self._free[key]
            else:
                stored.append(key)
            self._pins[key] = 1
        evicted = self._evict()
        return hit, stored, evicted

    def release(self, keys: Sequence[Hashable]) -> None:
        """Unpin a finished request's chain, freeing its blocks tail-first."""
        for key in reversed(keys):
            ref = self._pins.get(key)
            if ref is None:
                raise ValueError("release of a block that is not pinned")
            if ref > 1:
                self._pins[key] = ref - 1
            else:
                del self._pins[key]
                self._free[key] = None  # most recently freed: evicted last

    def _evict(self) -> list[Hashable]:
        evicted: list[Hashable] = []
        while len(self) > self.capacity and self._free:
            key, _ = self._free.popitem(last=False)
            evicted.append(key)
        self.evictions += len(evicted)
        self.overflow_peak = max(self.overflow_peak, len(self) - self.capacity)
        return evicted
