"""BlockIndex: exact longest-prefix walks over real and speculative entries."""

from __future__ import annotations

from gateway.routing.index import BlockIndex


def test_longest_prefix_counts_from_block_zero() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2, 3, 4, 5])
    index.add("c", [2, 3, 4])  # no block 0: never a hit
    assert index.longest_prefix([1, 2, 3, 4, 5, 6]) == {"a": 3, "b": 5}
    assert index.longest_prefix([1, 9, 3]) == {"a": 1, "b": 1}
    assert index.longest_prefix([9, 1]) == {}
    assert index.longest_prefix([]) == {}


def test_a_hole_in_the_chain_ends_the_run() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 4, 5])
    assert index.longest_prefix([1, 2, 3, 4, 5]) == {"a": 2}


def test_remove_clear_replace_drop() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    index.remove("a", [2, 99])
    assert index.longest_prefix([1, 2, 3]) == {"a": 1, "b": 2}
    index.replace("a", [1, 2, 3, 4])
    assert index.block_count("a") == 4
    assert index.longest_prefix([1, 2, 3, 4]) == {"a": 4, "b": 2}
    index.clear("b")
    assert index.block_count("b") == 0 and "b" in index.workers()
    index.drop("a")
    assert index.workers() == ["b"]
    assert index.longest_prefix([1, 2, 3]) == {}
    index.add("a", [1, 1, 1])  # idempotent
    assert index.block_count("a") == 1


def test_speculative_entries_expire() -> None:
    index = BlockIndex()
    index.add("a", [1])
    index.speculate("b", [1, 2, 3], now=100.0, ttl=2.0)
    assert index.longest_prefix([1, 2, 3], now=101.0) == {"a": 1, "b": 3}
    assert index.longest_prefix([1, 2, 3], now=102.5) == {"a": 1}
    assert index.longest_prefix([1, 2, 3]) == {"a": 1}  # no clock: real entries only
    assert index.block_count("b") == 0  # speculation is not a real block
    assert index.prune(now=102.5) == 3
    assert index.speculative_count() == 0


def test_speculation_off_and_drop_clears_it() -> None:
    index = BlockIndex()
    index.speculate("a", [1], now=0.0, ttl=0.0)
    assert index.speculative_count() == 0
    index.add("a", [])
    index.speculate("a", [1, 2], now=0.0, ttl=5.0)
    index.drop("a")
    assert index.longest_prefix([1, 2], now=1.0) == {}
