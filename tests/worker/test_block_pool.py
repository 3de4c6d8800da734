"""BlockPool on a tiny pool (12 blocks of 4 tokens): exact block ids, exact eviction order."""

from __future__ import annotations

import pytest

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored
from contract.hashing import HashSpec, block_hashes
from worker.engine.block_pool import BlockPool

BS = 4
SPEC = HashSpec(block_size=BS, model="test")


def cache_chain(pool: BlockPool, ids: list[int], tokens: list[int]) -> list[int]:
    """Registers ``ids`` as the computed blocks of ``tokens``; returns their hashes."""
    hashes = block_hashes(tokens, SPEC)
    pool.cache_blocks(ids, hashes, tokens, None)
    return hashes


def free_ids(pool: BlockPool) -> list[int]:
    """The free list in eviction order (a white-box view, for exact order checks)."""
    return list(pool._free)


def test_fresh_pool_allocates_lowest_ids_and_refuses_without_side_effects() -> None:
    pool = BlockPool(12, BS)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(10) is None
    assert pool.num_free_blocks == 9
    assert pool.allocate(9) == list(range(3, 12))
    assert pool.allocate(1) is None
    assert pool.take_events() == []


def test_cache_emits_one_stored_event_with_parent_and_lookup_confirms_tokens() -> None:
    pool = BlockPool(12, BS)
    ids = pool.allocate(3)
    assert ids is not None
    tokens = list(range(100, 112))
    hashes = cache_chain(pool, ids, tokens)
    assert pool.take_events() == [BlockStored(tuple(hashes), None)]
    assert pool.num_cached_blocks == 3
    assert pool.lookup(hashes[1], tokens[4:8]) is pool.blocks[1]
    # Same hash, other tokens: a collision never counts as a hit.
    assert pool.lookup(hashes[1], [1, 2, 3, 4]) is None
    assert pool.match_prefix(hashes, tokens) == [0, 1, 2]
    # A wrong middle token stops the run there.
    assert pool.match_prefix(hashes, [*tokens[:5], 7, *tokens[6:]]) == [0]


def test_tail_first_free_evicts_suffix_before_prefix_and_lazily() -> None:
    pool = BlockPool(12, BS)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    tokens = list(range(12))
    hashes = cache_chain(pool, ids, tokens)
    pool.take_events()
    pool.free(reversed(ids))
    assert free_ids(pool) == [*range(3, 12), 2, 1, 0]
    # Freed blocks keep their hash until reused: still a full hit.
    assert pool.match_prefix(hashes, tokens) == [0, 1, 2]
    assert pool.num_cached_blocks == 3
    # Never-used blocks go first, then the tail, then the middle: the prefix lives longest.
    assert pool.allocate(9) == list(range(3, 12))
    assert pool.take_events() == []
    assert pool.allocate(1) == [2]
    assert pool.take_events() == [BlockRemoved((hashes[2],))]
    assert pool.allocate(1) == [1]
    assert pool.take_events() == [BlockRemoved((hashes[1],))]
    assert pool.match_prefix(hashes, tokens) == [0]
    assert pool.evictions_total == 2


def test_touch_takes_a_free_hit_out_of_the_lru_and_can_allocate_counts_it() -> None:
    pool = BlockPool(4, BS)
    ids = pool.allocate(2)
    assert ids == [0, 1]
    tokens = list(range(8))
    cache_chain(pool, ids, tokens)
    pool.free(reversed(ids))
    assert free_ids(pool) == [2, 3, 1, 0]
    # Two hits in the free list: only 2 fresh blocks remain besides them.
    assert pool.can_allocate(2, [0, 1])
    assert not pool.can_allocate(3, [0, 1])
    pool.touch([0, 1])
    assert free_ids(pool) == [2, 3]
    assert pool.blocks[0].ref_cnt == 1
    # A second sharer only raises the count.
    pool.touch([0])
    pool.free([0])
    assert pool.blocks[0].ref_cnt == 1
    assert pool.allocate(2) == [2, 3]
    assert pool.take_events() == [BlockStored(tuple(block_hashes(tokens, SPEC)), None)]


def test_duplicate_hash_is_not_registered_twice_and_splits_the_stored_run() -> None:
    pool = BlockPool(12, BS)
    tokens = list(range(12))
    first = pool.allocate(1)
    assert first == [0]
    hashes = block_hashes(tokens, SPEC)
    pool.cache_blocks([0], hashes[1:2], tokens[4:8], hashes[0])  # block 1's content, elsewhere
    pool.take_events()
    ids = pool.allocate(3)
    assert ids == [1, 2, 3]
    assert pool.cache_blocks(ids, hashes, tokens, None) == 2
    assert pool.take_events() == [
        BlockStored((hashes[0],), None),
        BlockStored((hashes[2],), hashes[1]),
    ]
    assert pool.blocks[2].block_hash is None  # the duplicate stays a plain block
    assert pool.match_prefix(hashes, tokens) == [1, 0, 3]


def test_pinned_blocks_survive_pressure_until_unpinned() -> None:
    pool = BlockPool(6, BS)
    ids = pool.allocate(2)
    assert ids == [0, 1]
    tokens = list(range(8))
    hashes = cache_chain(pool, ids, tokens)
    pool.pin(ids)
    pool.free(reversed(ids))  # the sequence that computed them is done
    assert pool.num_pinned_blocks == 2
    assert pool.num_free_blocks == 4
    assert pool.allocate(5) is None
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert pool.match_prefix(hashes, tokens) == [0, 1]
    assert pool.take_events()[-1] == BlockStored(tuple(hashes), None)
    assert pool.unpin([0, 1, 2]) == 2  # block 2 was never pinned
    assert pool.num_pinned_blocks == 0
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 1, 1, 1, 1]
    assert free_ids(pool) == [0, 1]


def test_reset_refuses_while_in_use_then_clears_every_hash() -> None:
    pool = BlockPool(12, BS)
    ids = pool.allocate(2)
    assert ids is not None
    tokens = list(range(8))
    hashes = cache_chain(pool, ids, tokens)
    pool.take_events()
    assert pool.reset() is False
    assert pool.take_events() == []
    pool.free(reversed(ids))
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.resident_hashes() == set()
    assert pool.match_prefix(hashes, tokens) == []
    # Reusing a cleared block evicts nothing.
    assert pool.allocate(12) == [*range(2, 12), 1, 0]
    assert pool.take_events() == []


def test_counters_and_over_free_guard() -> None:
    pool = BlockPool(12, BS)
    ids = pool.allocate(3)
    assert ids is not None
    cache_chain(pool, ids[:2], list(range(8)))
    pool.pin([ids[0]])
    assert (pool.num_used_blocks, pool.num_cached_blocks, pool.num_pinned_blocks) == (3, 2, 1)
    pool.free(ids)
    assert (pool.num_used_blocks, pool.num_free_blocks) == (1, 11)
    with pytest.raises(RuntimeError):
        pool.free([ids[1]])


def test_caching_disabled_never_hits_or_stores() -> None:
    pool = BlockPool(12, BS, enable_caching=False)
    ids = pool.allocate(2)
    assert ids is not None
    tokens = list(range(8))
    hashes = block_hashes(tokens, SPEC)
    assert pool.cache_blocks(ids, hashes, tokens, None) == 0
    assert pool.match_prefix(hashes, tokens) == []
    assert pool.take_events() == []


def test_bad_sizes_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--num-blocks"):
        BlockPool(0, BS)
    with pytest.raises(ValueError, match="--block-size"):
        BlockPool(4, 0)
