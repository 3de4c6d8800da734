"""Incremental detokenization and stop strings on SmolLM2's real byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.serve.text_stream import Detokenizer, TextStream

TEXT = "héllo 世界 🎉 ok"


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_multibyte_characters_split_across_tokens_come_out_whole(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case under test
    detok = Detokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[4:9] == ["", "世", "", "", "界"]  # held until the last byte arrives


def test_special_tokens_are_skipped(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    ids = [*tokenizer.encode("ok", add_special_tokens=False), tokenizer.eos_token_id]
    assert detok.push(ids) + detok.flush() == "ok"


def test_stop_string_cuts_and_never_leaks_a_prefix(tokenizer) -> None:
    ids = tokenizer.encode("hello world, goodbye", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["o world", "zz"])
    out = []
    for i in ids:
        out.append(stream.push([i]))
        if stream.stopped:
            break
    assert stream.stopped and "".join(out) == "hell" == stream.text
    assert stream.push([ids[-1]]) == "" and stream.flush() == ""


def test_held_back_text_is_released_at_the_end(tokenizer) -> None:
    stream = TextStream(tokenizer, stop=["world!"])
    ids = tokenizer.encode("hello wor", add_special_tokens=False)
    emitted = "".join(stream.push([i]) for i in ids)
    assert not stream.stopped and "hello wor".startswith(emitted) and emitted != "hello wor"
    assert emitted + stream.flush() == "hello wor"
