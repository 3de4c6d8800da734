"""ChatTokenizer and its incremental prefix cache on the real SmolLM2 and Qwen3 tokenizers.

The property: however a conversation grows (or is edited), the ids from the
incremental path equal a full re-tokenization of the rendered chat.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.hashing import HashSpec, block_hashes
from gateway.text.prefix_tokens import PrefixTokenCache, Prompt
from gateway.text.tokenizer import ChatTokenizer


def _production_ids(tok: ChatTokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Ids through the gateway's own request path (render, then the incremental encoder)."""
    return asyncio.run(tok.aencode_rendered(tok.render(messages))).ids


_PIECES = st.sampled_from(
    [
        "hello",
        " world",
        "\n",
        "\n\n",
        "  ",
        "\t",
        "é",
        "世界",
        "🙂",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "user",
        "assistant",
        "!",
        " 123",
        "ü̈",
        "\r\n",
        "<b>",
    ]
)
_TEXT = st.lists(st.one_of(_PIECES, st.text(max_size=6)), max_size=8).map("".join)
_TURNS = st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=5)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(system=st.one_of(st.none(), _TEXT), turns=_TURNS, edit=_TEXT)
def test_incremental_ids_equal_full_tokenization(
    chat_tokenizer: ChatTokenizer, system: str | None, turns: list[tuple[str, str]], edit: str
) -> None:
    tok = chat_tokenizer
    assert tok.prefix_cache is not None
    messages: list[dict[str, str]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    for i, (user, answer) in enumerate(turns):
        messages.append({"role": "user", "content": user})
        full = tok.encode_text(tok.render(messages))
        assert _production_ids(tok, messages) == full
        if i % 2:  # every other answer is pre-tokenized, as the gateway does after a response
            asyncio.run(tok.remember_answer(messages, answer))
        messages.append({"role": "assistant", "content": answer})
    # A regenerated answer: the same history with the last assistant message changed.
    messages[-1] = {"role": "assistant", "content": edit}
    messages.append({"role": "user", "content": "again"})
    assert _production_ids(tok, messages) == tok.encode_text(tok.render(messages))


async def test_async_path_matches_and_reuses(chat_tokenizer: ChatTokenizer) -> None:
    tok = chat_tokenizer
    cache = tok.prefix_cache
    assert cache is not None
    messages = [{"role": "user", "content": "x" * 5000}]  # long: goes to the executor
    text = tok.render(messages)
    first = await tok.aencode_rendered(text)
    assert first.ids == tok.encode_text(text)
    spec = HashSpec(block_size=16, model="m")
    assert first.block_hashes(spec) == block_hashes(first.ids, spec)
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    hits = cache.hits
    text = tok.render(messages)
    second = await tok.aencode_rendered(text)
    assert second.ids == tok.encode_text(text)
    assert cache.hits == hits + 1
    # The reused prefix brings its chain: only the new blocks are hashed.
    assert second.reused is not None and spec in second.reused.chains
    assert second.block_hashes(spec) == block_hashes(second.ids, spec)


async def test_pretokenized_answer_leaves_only_the_new_message(
    chat_tokenizer: ChatTokenizer,
) -> None:
    tok = chat_tokenizer
    cache = tok.prefix_cache
    assert cache is not None
    messages = [{"role": "user", "content": "first question " * 20}]
    await tok.aencode_rendered(tok.render(messages))
    answer = "a long answer " * 30
    await tok.remember_answer(messages, answer)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    text = tok.render(messages)
    plan = cache.plan(text)
    # Everything up to the new user message is reused; the answer is not tokenized again.
    assert text[plan.cut :].count(cache.marker) == 2  # the user message and the generation prompt
    assert answer not in text[plan.cut :]
    prompt = await tok.aencode_rendered(text)
    assert prompt.ids == tok.encode_text(text)


async def test_an_answer_is_new_once_per_prompt(chat_tokenizer: ChatTokenizer) -> None:
    tok = chat_tokenizer
    text = tok.render([{"role": "user", "content": "Is it raining?"}])
    prompt = await tok.aencode_rendered(text)
    assert prompt.text == text
    assert tok.answer_is_new(prompt, "yes")
    assert not tok.answer_is_new(prompt, "yes")
    assert tok.answer_is_new(prompt, "no")  # another answer
    assert tok.answer_is_new(await tok.aencode_rendered(text[:-1]), "yes")  # another prompt
    assert not tok.answer_is_new(Prompt(prompt.ids), "maybe")  # not a chat: never remembered
    # Bounded: the least recently seen are forgotten (and then count as new again).
    for i in range(tok._answers_seen_max):
        tok.answer_is_new(Prompt([i], text=str(i)), "filler")
    assert tok.answer_is_new(prompt, "yes")


def test_smollm2_matches_apply_chat_template(smollm2: Path) -> None:
    tok = ChatTokenizer(smollm2)
    messages = [{"role": "user", "content": "Hi there"}]
    expected = tok.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert _production_ids(tok, messages) == list(expected)
    assert tok.prefix_cache is not None and tok.prefix_cache.marker == "<|im_start|>"
    assert tok.max_model_len > 0


def test_prefix_cache_lru_bounds() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    cache = PrefixTokenCache("#", ord("#"), max_entries=3, max_tokens=12)
    # Each text remembers its last two #-aligned prefixes.
    assert cache.encode("a#b#c", encode).ids == encode("a#b#c")
    assert len(cache) == 2 and cache.cached_tokens == 1 + 3
    plan = cache.plan("a#b#zz")
    assert plan.cut == 3 and plan.prefix_ids == encode("a#b")
    cache.encode("qqqqqqqq#r#s", encode)  # 8 + 10 tokens: over the token budget
    assert cache.cached_tokens <= 12
    assert len(cache) <= 3
    assert cache.plan("nothing").cut == 0
