"""Workload generators: seeded determinism, exact shapes, shared prefixes."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from contract.hashing import HashSpec, block_hashes
from loadtest.words import WORD_ID_BASE, WORDS, ids_to_text
from loadtest.workloads import (
    ChatConfig,
    SharedPrefixConfig,
    chat_workload,
    conversation_shapes,
    shared_prefix_workload,
)

CHAT = ChatConfig(
    users=5,
    turns=3,
    system_tokens=40,
    question_tokens=7,
    answer_tokens=11,
    think_time_s=1.5,
    arrival_rate=2.0,
    seed=3,
)


def test_chat_is_deterministic_in_its_seed() -> None:
    assert chat_workload(CHAT) == chat_workload(CHAT)
    other = chat_workload(ChatConfig(**{**CHAT.__dict__, "seed": 4}))
    assert other[0].system_ids != chat_workload(CHAT)[0].system_ids


def test_chat_shapes_and_arrivals() -> None:
    convs = chat_workload(CHAT)
    assert len(convs) == 5
    assert convs[0].start_s == 0.0
    assert all(a.start_s < b.start_s for a, b in pairwise(convs))
    assert len({c.system_ids for c in convs}) == 1  # one shared system prompt
    for c in convs:
        assert len(c.system_ids) == 40 and len(c.turns) == 3
        assert c.turns[0].think_s == 0.0 and all(t.think_s > 0 for t in c.turns[1:])
        assert all(len(t.user_ids) == 7 and len(t.answer_ids) == 11 for t in c.turns)
        assert all(t.max_tokens == 11 for t in c.turns)
        assert len(c.prompt_ids(2)) == 40 + 2 * (7 + 11) + 7


def test_chat_messages_are_real_words_with_history() -> None:
    conv = chat_workload(CHAT)[1]
    msgs = conv.messages(2, answers=["first real answer", "second real answer"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == "first real answer"
    assert msgs[4]["content"] == "second real answer"
    assert all(w in WORDS for w in msgs[0]["content"].split())
    assert len(msgs[0]["content"].split()) == 40
    assert conv.messages(1)[2]["content"] == conv.turns[0].answer_text  # scripted fallback
    with pytest.raises(ValueError):
        conv.messages(3)


def test_words_map_one_to_one_onto_ids() -> None:
    assert ids_to_text([WORD_ID_BASE, WORD_ID_BASE + 2]) == f"{WORDS[0]} {WORDS[2]}"


def test_conversation_shapes_chain_turns_and_share_the_system_prompt() -> None:
    spec = HashSpec(block_size=8)
    convs = chat_workload(CHAT)
    shapes = conversation_shapes(convs, spec)
    assert len(shapes) == 15
    t0, t1, t2 = shapes[0:3]
    assert (t0.after, t1.after, t2.after) == (None, t0.request_id, t1.request_id)
    assert t1.think_s == convs[0].turns[1].think_s
    assert t1.prompt_tokens == 40 + 7 + 11 + 7
    assert list(t1.block_keys) == block_hashes(convs[0].prompt_ids(1), spec)
    # The answer's blocks extend the prompt's chain, and the next turn starts with both.
    assert t1.block_keys[: len(t0.block_keys + t0.output_block_keys)] == (
        t0.block_keys + t0.output_block_keys
    )
    # Every user shares the 5 full blocks of the 40-token system prompt, and nothing more.
    firsts = {s.block_keys[:5] for s in shapes}
    assert len(firsts) == 1
    assert len({s.block_keys[5] for s in shapes if s.turn == 1}) == 5


def test_shared_prefix_groups() -> None:
    cfg = SharedPrefixConfig(
        groups=3,
        prompts_per_group=4,
        system_tokens=32,
        question_tokens=5,
        output_tokens=6,
        arrival_rate=10.0,
        seed=1,
    )
    convs = shared_prefix_workload(cfg)
    assert convs == shared_prefix_workload(cfg)
    assert len(convs) == 12
    by_group: dict[str, set[tuple[int, ...]]] = {}
    for c in convs:
        by_group.setdefault(c.conv_id[:4], set()).add(c.system_ids)
        assert len(c.turns) == 1 and c.turns[0].max_tokens == 6
    assert sorted(by_group) == ["g000", "g001", "g002"]
    assert all(len(s) == 1 for s in by_group.values())
    assert len({next(iter(s)) for s in by_group.values()}) == 3
    shapes = conversation_shapes(convs, HashSpec(block_size=16))
    assert all(s.prompt_tokens == 37 and len(s.block_keys) == 2 for s in shapes)
    assert len({s.block_keys for s in shapes}) == 3  # one chain per group


@pytest.mark.parametrize(
    ("field", "flag"),
    [("users", "--users"), ("turns", "--turns"), ("arrival_rate", "--arrival-rate")],
)
def test_bad_config_names_the_flag(field: str, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ChatConfig(**{field: 0})


def test_zipf_shared_prefix_makes_a_few_prefixes_hot() -> None:
    from collections import Counter

    from loadtest.workloads import SharedPrefixConfig, shared_prefix_workload

    cfg = SharedPrefixConfig(
        groups=8, prompts_per_group=16, system_tokens=8, question_tokens=4, zipf=1.2
    )
    convs = shared_prefix_workload(cfg)
    assert [c.conv_id for c in convs] == [c.conv_id for c in shared_prefix_workload(cfg)]
    counts = Counter(c.conv_id[:4] for c in convs)
    assert len(convs) == 128 and counts["g000"] >= 3 * counts["g007"] > 0
    uniform = Counter(c.conv_id[:4] for c in shared_prefix_workload(replace(cfg, zipf=0.0)))
    assert set(uniform.values()) == {16}
