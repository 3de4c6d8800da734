"""Incremental detokenization (multi-byte characters split across tokens) and stop strings."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openai_api.detokenizer import Detokenizer, ids_decoder


@pytest.fixture(scope="module")
def tok(smollm2: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def _stream(detok: Detokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(detok.push(ids[i : i + size]))
        i += size
    if i < len(ids):
        out.append(detok.push(ids[i:]))
    out.append(detok.finish())
    return out


def test_emoji_split_over_tokens_comes_out_whole(tok: Any) -> None:
    ids = tok.encode("ok 🙂🙂 世界", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # really split across tokens
    detok = Detokenizer(tok, tok.encode("prompt", add_special_tokens=False))
    pieces = [detok.push([i]) for i in ids] + [detok.finish()]
    assert "".join(pieces) == "ok 🙂🙂 世界"
    assert not any("\ufffd" in p for p in pieces)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=40), sizes=st.lists(st.integers(1, 4), max_size=30))
def test_streamed_text_equals_full_decode(tok: Any, text: str, sizes: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = Detokenizer(tok, [1, 4093, 198])
    streamed = "".join(_stream(detok, ids, sizes))
    assert streamed == tok.decode(ids, skip_special_tokens=True)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    sizes=st.lists(st.integers(1, 16), max_size=20),
)
def test_ids_pushed_together_give_the_text_of_ids_pushed_one_by_one(
    tok: Any, ids: list[int], sizes: list[int]
) -> None:
    # Any ids, so byte tokens that never complete a character are in the groups too.
    together = "".join(_stream(Detokenizer(tok, [1, 4093, 198]), ids, sizes))
    one_by_one = "".join(_stream(Detokenizer(tok, [1, 4093, 198]), ids, [1] * len(ids)))
    assert together == one_by_one


def test_special_tokens_are_skipped(tok: Any) -> None:
    ids = [*tok.encode("Hello", add_special_tokens=False), 2]  # <|im_end|>
    detok = Detokenizer(tok, [])
    assert "".join(_stream(detok, ids, [1, 1])) == "Hello"


def test_stop_string_across_chunks_is_cut_and_held_back(tok: Any) -> None:
    ids = tok.encode("one two STOP three", add_special_tokens=False)
    detok = Detokenizer(tok, [], stop=["STOP", "never"])
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "one two "
    assert detok.stopped
    assert "S" not in "".join(pieces)
    assert detok.push(tok.encode(" more", add_special_tokens=False)) == ""
    assert detok.finish() == ""
    assert detok.output_text == "one two "


def test_earliest_stop_wins_and_partial_match_is_flushed(tok: Any) -> None:
    detok = Detokenizer(tok, [], stop=["b c", "a"])
    ids = tok.encode("xx b c a", add_special_tokens=False)
    assert "".join(_stream(detok, ids, [1] * len(ids))) == "xx "
    # A tail that only looks like the start of a stop string comes out at the end.
    detok = Detokenizer(tok, [], stop=["END!"])
    ids = tok.encode("the END", add_special_tokens=False)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "the "
    assert detok.finish() == "END"
    assert not detok.stopped


def test_stop_at_start_gives_empty_text(tok: Any) -> None:
    detok = Detokenizer(tok, [], stop=["Hi"])
    assert detok.push(tok.encode("Hi there", add_special_tokens=False)) == ""
    assert detok.stopped and detok.output_text == ""


def test_stop_string_cuts_and_never_leaks_a_prefix(tok) -> None:
    ids = tok.encode("hello world, goodbye", add_special_tokens=False)
    detok = Detokenizer(tok, stop=["o world", "zz"])
    out = []
    for i in ids:
        out.append(detok.push([i]))
        if detok.stopped:
            break
    assert detok.stopped and "".join(out) == "hell" == detok.output_text
    assert detok.push([ids[-1]]) == "" and detok.finish() == ""


def test_overlapping_stop_prefixes_match_where_kmp_must_fall_back(tok) -> None:
    # "aab" inside "aaab": a naive matcher that resets on mismatch misses it.
    detok = Detokenizer(tok, stop=["aab"])
    assert detok.push(tok.encode("xaaab tail", add_special_tokens=False)) == "xa"
    assert detok.stopped


def test_earliest_completed_stop_wins_and_releases_a_longer_pending_one(tok) -> None:
    detok = Detokenizer(tok, stop=["abcdef", "cd"])
    assert detok.push(tok.encode("abcdef", add_special_tokens=False)) == "ab"
    assert detok.stopped


def test_long_stop_strings_cost_linear_time(tok) -> None:
    import time

    stops = ["x" * 30_000 + "!", "y" * 30_000]
    ids = tok.encode("x" * 4000, add_special_tokens=False)
    detok = Detokenizer(tok, stop=stops)
    started = time.process_time()
    for i in ids:
        detok.push([i])
    elapsed = time.process_time() - started
    assert detok.output_text == ""  # every x could still become the first stop string
    assert detok.finish() == "x" * 4000
    # Quadratic matching took seconds here; linear takes milliseconds.
    assert elapsed < 1.0


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 49_151), max_size=12), skip=st.booleans())
def test_the_rust_decoder_equals_the_wrapper(tok: Any, ids: list[int], skip: bool) -> None:
    decode = ids_decoder(tok, skip)
    assert isinstance(decode, partial)  # SmolLM2 cleans up no spaces: the Rust path
    assert decode(ids) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode() -> None:
    class CleaningTokenizer:
        clean_up_tokenization_spaces = True
        _tokenizer = object()  # never called: its decode would skip the clean-up

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"clean {ids} {skip_special_tokens}"

    assert ids_decoder(CleaningTokenizer(), True)([1, 2]) == "clean [1, 2] True"
