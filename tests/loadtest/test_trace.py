"""Mooncake trace replay: hash id -> fixed tokens, shared prefixes stay shared."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from contract.hashing import HashSpec, block_hashes
from loadtest.mooncake_trace import (
    TraceChains,
    TraceRecord,
    TraceTokens,
    load_trace,
    spread_arrivals,
)

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_head500.jsonl"


def test_same_id_same_tokens_and_different_ids_differ() -> None:
    tok = TraceTokens(vocab_size=5000, low_id=100, seed=7)
    a, b = tok.block(42), TraceTokens(vocab_size=5000, low_id=100, seed=7).block(42)
    assert a.shape == (512,) and np.array_equal(a, b)
    assert not np.array_equal(a, tok.block(43))
    assert not np.array_equal(a, TraceTokens(vocab_size=5000, low_id=100, seed=8).block(42))
    many = tok.blocks(list(range(200)))
    assert many.min() >= 100 and many.max() < 5000
    assert np.array_equal(many[42], a)


def test_prompt_is_its_blocks_with_a_partial_last_block() -> None:
    tok = TraceTokens()
    rec = TraceRecord(arrival_s=0.0, input_length=1100, output_length=5, hash_ids=(0, 9, 4))
    ids = tok.prompt_ids(rec)
    assert ids.shape == (1100,)
    assert np.array_equal(ids[512:1024], tok.block(9))
    assert np.array_equal(ids[1024:], tok.block(4)[:76])


def test_shared_hash_ids_give_shared_prefixes_and_chains() -> None:
    spec = HashSpec(block_size=512)
    chains = TraceChains(spec)
    a = TraceRecord(0.0, 2048, 1, (0, 1, 2, 3))
    b = TraceRecord(1.0, 1600, 1, (0, 1, 7, 8))
    ca, cb = chains.chain(a), chains.chain(b)
    assert len(ca) == 4 and len(cb) == 3
    assert ca[:2] == cb[:2] and ca[2] != cb[2]


@pytest.mark.parametrize("block_size", [512, 16, 100])
def test_memoised_chains_equal_hashing_the_tokens(block_size: int) -> None:
    records = load_trace(TRACE, limit=40)
    chains = TraceChains(HashSpec(block_size=block_size, model="m"))
    for rec in records:
        expected = block_hashes(chains.tokens.prompt_ids(rec), chains.spec)
        assert chains.chain(rec) == expected


def test_load_trace_limit_and_time_scale() -> None:
    recs = load_trace(TRACE, limit=300, time_scale=0.5)
    full = load_trace(TRACE, limit=300)
    assert len(recs) == 300
    assert recs[0].hash_ids == full[0].hash_ids
    assert recs[-1].arrival_s == pytest.approx(full[-1].arrival_s * 0.5)
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in recs)
    with pytest.raises(ValueError, match="--time-scale"):
        load_trace(TRACE, time_scale=0)


def test_spread_arrivals_spreads_each_instant_over_the_gap_to_the_next() -> None:
    def rec(t: float, n: int) -> TraceRecord:
        return TraceRecord(arrival_s=t, input_length=n, output_length=1, hash_ids=(n,))

    records = [rec(0.0, 1), rec(0.0, 2), rec(0.0, 3), rec(3.0, 4), rec(6.0, 5), rec(6.0, 6)]
    spread = spread_arrivals(records)
    assert [r.input_length for r in spread] == [1, 2, 3, 4, 5, 6]  # order kept
    assert [r.arrival_s for r in spread] == pytest.approx([0.0, 1.0, 2.0, 3.0, 6.0, 7.5])
    assert spread_arrivals([]) == []
    assert spread_arrivals(records[3:4]) == records[3:4]  # one instant, no gap to spread over


def test_spread_arrivals_on_the_shipped_trace_keeps_the_order_and_the_span() -> None:
    recorded = load_trace(TRACE, limit=500)
    spread = spread_arrivals(recorded)
    assert len({r.arrival_s for r in recorded}) < len(recorded) / 5  # about ten a 3 s instant
    assert len({r.arrival_s for r in spread}) == len(spread)
    assert [r.hash_ids for r in spread] == [r.hash_ids for r in recorded]
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(spread))
    assert spread[0].arrival_s == recorded[0].arrival_s
    assert all(abs(s.arrival_s - r.arrival_s) < 3.01 for s, r in zip(spread, recorded, strict=True))
