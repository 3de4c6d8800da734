"""The block-hash contract: golden vectors pin the function; properties pin its meaning."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from contract.hashing import HashSpec, block_hash, block_hashes, extend_block_hashes

# Golden vectors. If one of these fails, the hash function changed: every
# worker and gateway in a fleet must be upgraded together. Change deliberately.
GOLDEN = [
    (HashSpec(block_size=4, model="m"), list(range(10)), [0x4AABACED97CAF3B3, 0x904AB4D3C23D406F]),
    (
        HashSpec(model="SmolLM2-135M-Instruct"),
        list(range(32)),
        [0x153CD0C40524839B, 0x8A1846AB2E32BB86],
    ),
    (
        HashSpec(block_size=4, model="m", cache_salt="tenant-a"),
        [2**32 - 1] * 4,
        [0x7BF3222834AC6A52],
    ),
]


@pytest.mark.parametrize(("spec", "tokens", "expected"), GOLDEN)
def test_golden_vectors(spec: HashSpec, tokens: list[int], expected: list[int]) -> None:
    assert block_hashes(tokens, spec) == expected


def test_seed_golden() -> None:
    assert HashSpec(block_size=4, model="m").seed == 0x2F698E80E414F224


def test_chain_is_xxh3_over_parent_u64_and_tokens_u32_little_endian() -> None:
    spec = HashSpec(block_size=2, model="x")
    h0 = xxhash.xxh3_64_intdigest(struct.pack("<QII", spec.seed, 7, 8))
    h1 = xxhash.xxh3_64_intdigest(struct.pack("<QII", h0, 9, 10))
    assert block_hashes([7, 8, 9, 10, 11], spec) == [h0, h1]
    assert block_hash(h0, [9, 10], spec) == h1


def test_partial_block_is_never_hashed() -> None:
    spec = HashSpec(block_size=4)
    assert block_hashes([1, 2, 3], spec) == []
    assert len(block_hashes(list(range(7)), spec)) == 1


def test_bad_input_raises_value_error() -> None:
    spec = HashSpec(block_size=2)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        block_hashes([1, -1], spec)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        block_hashes([1, 2**32], spec)
    with pytest.raises(ValueError, match="block_size"):
        HashSpec(block_size=0)
    with pytest.raises(ValueError, match="exactly 2"):
        block_hash(0, [1], spec)
    with pytest.raises(ValueError, match="longer"):
        extend_block_hashes([1, 2], [1, 2], spec)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        block_hashes([1, 2.0], spec)  # a float is not a token id, even a whole one
    with pytest.raises(ValueError, match="2\\*\\*32"):
        block_hashes(np.array([1, -1]), spec)


def test_lists_and_arrays_of_ids_hash_alike() -> None:
    # Lists go through a C array, arrays through numpy: the same bytes either way.
    spec = HashSpec(block_size=4)
    ids = [0, 1, 2**32 - 1, 49_151, 7, 2**31, 3, 9]
    assert block_hashes(ids, spec) == block_hashes(np.array(ids, dtype=np.int64), spec)
    assert block_hashes(ids, spec) == block_hashes(np.array(ids, dtype=np.uint32), spec)
    assert block_hashes(tuple(ids), spec) == block_hashes(ids, spec)


tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
specs_st = st.builds(
    HashSpec,
    block_size=st.integers(min_value=1, max_value=16),
    model=st.text(max_size=8),
    lora=st.text(max_size=4),
    cache_salt=st.text(max_size=4),
)


@given(tokens=tokens_st, spec=specs_st, cut=st.integers(min_value=0, max_value=200))
def test_prefix_stability(tokens: list[int], spec: HashSpec, cut: int) -> None:
    full = block_hashes(tokens, spec)
    prefix = block_hashes(tokens[:cut], spec)
    assert full[: len(prefix)] == prefix
    assert len(full) == len(tokens) // spec.block_size


@given(tokens=tokens_st, spec=specs_st, cut=st.integers(min_value=0, max_value=200))
def test_incremental_equals_full(tokens: list[int], spec: HashSpec, cut: int) -> None:
    head = block_hashes(tokens[:cut], spec)
    assert head + extend_block_hashes(head, tokens, spec) == block_hashes(tokens, spec)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=40),
    spec=specs_st,
    field=st.sampled_from(["model", "revision", "lora", "cache_salt"]),
)
def test_identity_change_changes_every_hash(tokens: list[int], spec: HashSpec, field: str) -> None:
    from dataclasses import replace

    other = replace(spec, **{field: getattr(spec, field) + "'"})
    mine, theirs = block_hashes(tokens, spec), block_hashes(tokens, other)
    assert mine and not set(mine) & set(theirs)


def test_with_salt_and_lora() -> None:
    spec = HashSpec(model="m")
    assert spec.with_salt("") is spec
    assert spec.with_salt("t").cache_salt == "t"
    assert spec.with_lora("a").lora == "a"
    assert "cache_salt" not in spec.describe()


def test_length_prefixed_seed_fields_do_not_alias() -> None:
    assert HashSpec(model="ab", lora="c").seed != HashSpec(model="a", lora="bc").seed
