"""Plain completion prompts reuse the ids of earlier prompts' text (``gateway.text.prompt_prefix``).

The property, on the real SmolLM2 and Qwen3 tokenizers: whatever text two
prompts share and however they differ after it, the ids through the cache
equal a full tokenization with the tokenizer's special tokens.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.text.prompt_prefix import (
    ANCHOR_CHARS,
    JoinedSpans,
    PromptPrefixCache,
    anchor_keys,
    anchor_word_starts,
    is_cut,
    is_word_start,
    split_at_word_starts,
)
from gateway.text.tokenizer import PARALLEL_MIN_CHARS, ChatTokenizer


@pytest.fixture(scope="module")
def tok(chat_tokenizer: ChatTokenizer) -> ChatTokenizer:
    """SmolLM2's and Qwen3's tokenizers (``conftest.chat_tokenizer``), with a prompt cache."""
    assert chat_tokenizer.prompt_cache is not None
    return chat_tokenizer


def _ids(tok: ChatTokenizer, text: str) -> list[int]:
    return asyncio.run(tok.aencode_prompt(text)).ids


def _full(tok: ChatTokenizer, text: str) -> list[int]:
    return tok.encode_text(text, add_special_tokens=True)


# Words, spaces, newlines and the characters next to which a split would show.
_PIECES = st.sampled_from(
    [
        "hello",
        " world",
        " the",
        " a",
        "\n",
        "\n\n",
        "  ",
        " \n",
        "\t",
        ".",
        ", ",
        "'s",
        " don't",
        "é",
        " émigré",
        "世界",
        " 東京",
        "🙂",
        " 123",
        "4567",
        "<|im_start|>",
        "<|endoftext|>",
        "<b>",
        "\r\n",
        " ü̈",
        "ff",
        " Über",
    ]
)
_TEXT = st.lists(_PIECES, min_size=60, max_size=260).map("".join)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(base=_TEXT, tails=st.lists(st.tuples(st.floats(0, 1), _TEXT), min_size=1, max_size=4))
def test_prompts_sharing_text_get_the_full_ids(
    tok: ChatTokenizer, base: str, tails: list[tuple[float, str]]
) -> None:
    assert _ids(tok, base) == _full(tok, base)
    for fraction, tail in tails:
        text = base[: int(fraction * len(base))] + tail
        assert _ids(tok, text) == _full(tok, text)


def test_a_shared_prefix_is_reused_not_tokenized(tok: ChatTokenizer) -> None:
    cache = tok.prompt_cache
    assert cache is not None
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "12", "x.y", "Zeta"]
    shared = " ".join(rng.choice(words) for _ in range(8000)) + "\n"  # long: on the executor
    assert len(shared) >= tok.executor_min_chars
    first = shared + "first question?"
    assert _ids(tok, first) == _full(tok, first)
    hits, reused = cache.hits, cache.reused_tokens
    second = shared + "second question, longer than the first one."
    assert _ids(tok, second) == _full(tok, second)
    assert cache.hits == hits + 1
    # All but the last anchor's worth of the shared text came from the cache.
    assert cache.reused_tokens - reused > len(_full(tok, shared)) * (
        1 - 2 * ANCHOR_CHARS / len(shared)
    )


def test_a_prompt_the_context_refuses_is_not_remembered(tok: ChatTokenizer) -> None:
    cache = tok.prompt_cache
    assert cache is not None
    text = "never seen before " * 100
    n = len(_full(tok, text))
    before = len(cache)
    asyncio.run(tok.aencode_prompt(text, remember_below=n))
    assert len(cache) == before
    asyncio.run(tok.aencode_prompt(text, remember_below=n + 1))
    assert len(cache) == before + 1


def test_cuts_are_word_starts_and_line_starts() -> None:
    text = "ab cd\nef  gh,\n ij k1 2"
    cuts = [p for p in range(len(text)) if is_cut(text, p)]
    # Before " cd" and " k1"'s letter run; after a newline followed by a non-space.
    assert [text[p : p + 3] for p in cuts] == [" cd", "ef ", " k1"]


def test_anchor_keys_chain_over_whole_anchors() -> None:
    a = "x" * (3 * ANCHOR_CHARS + 5)
    b = a[: 2 * ANCHOR_CHARS] + "y" * (ANCHOR_CHARS + 5)
    ka, kb = anchor_keys(a), anchor_keys(b)
    assert len(ka) == len(kb) == 3
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert anchor_keys("x" * (ANCHOR_CHARS - 1)) == []


class _WordSpans:
    """One token per word, each but the first with its leading space."""

    def __init__(self, text: str) -> None:
        self.offsets: list[tuple[int, int]] = []
        start = 0
        for word in text.split(" "):
            end = start + len(word) + (1 if start else 0)
            self.offsets.append((start, end))
            start = end

    def __len__(self) -> int:
        return len(self.offsets)

    def char_to_token(self, char_pos: int) -> int | None:
        hits = [i for i, (a, b) in enumerate(self.offsets) if a <= char_pos < b]
        return hits[0] if hits else None

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None:
        return self.offsets[token_index]


def test_lru_evicts_whole_prompts_and_their_anchors() -> None:
    cache = PromptPrefixCache(max_entries=2, max_tokens=10_000)
    texts = [f"{i} " + " ".join(["word"] * 120) for i in range(3)]  # differ from character 0

    def remember(text: str) -> None:
        plan = cache.plan(text)
        spans = _WordSpans(text)
        cache.remember(text, list(range(len(spans))), spans, plan.keys)

    for text in texts:
        remember(text)
    assert len(cache) == 2
    assert cache.plan(texts[0]).cut == 0  # evicted, anchors and all
    plan = cache.plan(texts[2] + " more")
    assert plan.cut > 0 and is_cut(texts[2], plan.cut)
    assert plan.prefix_ids == list(range(len(texts[2][: plan.cut].split(" "))))


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, parts=st.integers(1, 8))
def test_split_at_word_starts_gives_back_the_text_in_pieces_that_start_at_words(
    text: str, parts: int
) -> None:
    pieces = split_at_word_starts(text, parts)
    assert "".join(pieces) == text and 1 <= len(pieces) <= parts
    start = 0
    for piece in pieces:
        assert piece  # no empty piece
        assert start == 0 or is_word_start(text, start)
        start += len(piece)
    assert split_at_word_starts("x" * 100, 4) == ["x" * 100]  # nowhere to cut: one piece


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chunks=st.lists(_TEXT, min_size=4, max_size=8))
def test_long_texts_encoded_in_parallel_pieces_get_the_whole_texts_ids(
    tok: ChatTokenizer, chunks: list[str]
) -> None:
    # Long enough for one piece per core (the pieces are encoded at once).
    text = "".join(chunks)
    while len(text) < 2 * PARALLEL_MIN_CHARS:
        text += text
    assert tok.splits_at_word_starts
    whole = tok.encode_text(text)
    assert tok._encode_releasing_gil(text) == whole
    assert asyncio.run(tok.aencode_rendered(text)).ids == whole


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chunks=st.lists(_TEXT, min_size=2, max_size=6), parts=st.integers(2, 5))
def test_joined_spans_answer_as_the_whole_texts_encoding(
    tok: ChatTokenizer, chunks: list[str], parts: int
) -> None:
    assert tok._fast is not None
    text = "".join(chunks)
    whole = tok._fast.encode(text, add_special_tokens=False)
    texts = split_at_word_starts(text, parts)
    joined = JoinedSpans(tok._fast.encode_batch(texts, add_special_tokens=False), texts)
    assert joined.ids == whole.ids and len(joined) == len(whole.ids)
    for p in range(len(text) + 1):
        assert joined.char_to_token(p) == whole.char_to_token(p), p
    for i in range(len(whole.ids) + 1):
        assert joined.token_to_chars(i) == whole.token_to_chars(i), i


def test_long_prompts_in_pieces_get_the_full_ids_and_share_their_prefix(
    tok: ChatTokenizer,
) -> None:
    rng = random.Random(7)
    words = ["alpha", " beta", " gamma", "\n", " δέλτα", " 東京", " 42", ",", " don't", "\n\n"]
    base = "".join(rng.choice(words) for _ in range(6000))
    assert len(base) >= 2 * PARALLEL_MIN_CHARS
    assert _ids(tok, base) == _full(tok, base)  # encoded in pieces, then remembered
    sibling = base[: len(base) * 3 // 4] + " epsilon zeta" * 50
    assert _ids(tok, sibling) == _full(tok, sibling)  # its prefix reused from the pieces


def test_a_tokenizer_that_does_not_split_at_word_cuts_gets_no_prompt_cache(
    tmp_path: Path, smollm2: Path
) -> None:
    """A SentencePiece-style ``Metaspace`` tokenizer marks each word with its own space."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "hello world\n" * 20]
    raw.train_from_iterator(corpus, trainers.BpeTrainer(special_tokens=["<unk>"], vocab_size=80))
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((smollm2 / "config.json").read_text())
    assert ChatTokenizer(tmp_path).prompt_cache is None


def test_a_tokenizer_whose_tokens_span_spaces_encodes_long_texts_whole(
    tmp_path: Path, smollm2: Path
) -> None:
    """BPE with no pre-tokenizer merges across spaces: pieces would not join up."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    corpus = ["the quick brown fox jumps over the lazy dog " * 20]
    raw.train_from_iterator(corpus, trainers.BpeTrainer(special_tokens=["<unk>"], vocab_size=120))
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((smollm2 / "config.json").read_text())
    tokenizer = ChatTokenizer(tmp_path)
    assert not tokenizer.splits_at_word_starts
    text = "the quick brown fox jumps over the lazy dog " * 800
    assert tokenizer._encode_releasing_gil(text) == tokenizer.encode_text(text)


@given(text=_TEXT, start_fraction=st.floats(0, 1))
def test_anchor_word_starts_are_in_each_anchors_window_after_the_start(
    text: str, start_fraction: float
) -> None:
    start = int(start_fraction * len(text))
    anchors = len(text) // ANCHOR_CHARS
    found = anchor_word_starts(text, start, anchors)
    assert [p for _, p in found] == sorted({p for _, p in found})  # strictly increasing
    for k, p in found:
        anchor = (k + 1) * ANCHOR_CHARS
        assert start < p <= anchor - 2 and p > anchor - ANCHOR_CHARS
        assert is_word_start(text, p) and is_cut(text, p)
        # the last word start in its window
        assert not any(is_word_start(text, q) for q in range(p + 1, anchor - 1))
