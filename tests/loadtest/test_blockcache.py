"""The simulated worker cache on tiny cases with exact hits and evictions."""

from __future__ import annotations

import pytest

from loadtest.blockcache import BlockCache


def test_hits_inserts_and_tail_first_lru_eviction() -> None:
    cache = BlockCache(4)
    assert cache.acquire(["a", "b", "c"]) == (0, ["a", "b", "c"], [])
    cache.release(["a", "b", "c"])  # freed tail-first: LRU order c, b, a
    # a, b hit; d, e are new; one block must go and it is the leaf c, not the prefix.
    assert cache.acquire(["a", "b", "d", "e"]) == (2, ["d", "e"], ["c"])
    cache.release(["a", "b", "d", "e"])  # LRU order now e, d, b, a
    assert cache.match(["a", "b", "c"]) == 2
    assert cache.acquire(["x"]) == (0, ["x"], ["e"])
    cache.release(["x"])
    assert cache.match(["a", "b", "d", "e"]) == 3
    assert cache.evictions == 2 and len(cache) == 4


def test_a_hole_ends_the_hit() -> None:
    cache = BlockCache(8)
    cache.acquire(["a", "c"])
    assert cache.match(["a", "b", "c"]) == 1
    assert cache.match(["b", "a"]) == 0


def test_pinned_blocks_are_never_evicted() -> None:
    cache = BlockCache(3)
    cache.acquire(["a", "b"])  # running: pinned
    cache.acquire(["p"])
    cache.release(["p"])
    hit, stored, evicted = cache.acquire(["c", "d"])
    assert (hit, stored, evicted) == (0, ["c", "d"], ["p"])  # only the free block can go
    assert len(cache) == 4 and cache.overflow_peak == 1  # over capacity rather than evict a pin
    assert cache.pinned == 4 and cache.free_blocks == 0
    cache.release(["a", "b"])
    cache.release(["c", "d"])
    assert cache.free_blocks == 3


def test_shared_blocks_are_reference_counted() -> None:
    cache = BlockCache(2)
    cache.acquire(["a"])
    cache.acquire(["a", "b"])
    cache.release(["a", "b"])
    assert cache.pinned == 1  # the first request still holds a
    assert cache.acquire(["z"]) == (0, ["z"], ["b"])
    with pytest.raises(ValueError):
        cache.release(["q"])
    with pytest.raises(ValueError, match="--capacity-tokens"):
        BlockCache(0)
