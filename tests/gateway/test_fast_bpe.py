"""tiktoken's encoder gives exactly the HF tokenizer's ids, or hands the text back.

Real tokenizers (SmolLM2's and Qwen3's ``tokenizer.json``) against the Rust
``tokenizers`` library they ship for: the whole vocabulary, a property test on
mixed-script text with added tokens, characters the vocabulary lacks, and the
shapes ``FastBpe`` refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gateway.text.fast_bpe import FastBpe, _missing_byte_chars, _to_bytes
from gateway.text.tokenizer import ChatTokenizer
from tests.models import qwen3_tokenizer_dir


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def folder(request: pytest.FixtureRequest) -> Path:
    if request.param == "smollm2":
        path: Path = request.getfixturevalue("smollm2")
        return path
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="module")
def spec(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "tokenizer.json").read_text())
    return data


@pytest.fixture(scope="module")
def hf(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def fast(spec: dict[str, Any]) -> FastBpe:
    built = FastBpe._from_spec(spec, tiktoken)
    assert isinstance(built, FastBpe), built
    return built


def _hf_ids(hf: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [list(e.ids) for e in hf.encode_batch_fast(texts, add_special_tokens=False)]


def test_every_vocabulary_token_as_text(spec: dict[str, Any], hf: Tokenizer, fast: FastBpe) -> None:
    texts = [_to_bytes(t).decode("utf-8", errors="replace") for t in spec["model"]["vocab"]]
    handed_back = 0
    for text, expected in zip(texts, _hf_ids(hf, texts), strict=True):
        got = fast.encode(text)
        if got is None:
            handed_back += 1
        else:
            assert got == expected, text
    assert handed_back < len(texts) // 20  # most of the vocabulary goes the fast way


def test_loads_for_both_tokenizers_and_is_used(folder: Path) -> None:
    tok = ChatTokenizer(folder, cache_entries=8, cache_tokens=10_000)
    assert tok._bpe is not None
    assert ChatTokenizer(folder, fast_bpe=False)._bpe is None


_ALPHABET = st.sampled_from(
    [
        *"abcXYZ 019'\"sdtlmvre.,;:!?-_()[]{}<>|/\\@#$%^&*+=~`",
        *" \t\n\r\x0b\x0c",
        *"\x00\x04\x06\x13\x14\x16\x1d\x7f",  # control bytes SmolLM2's vocabulary lacks
        *"éüßñçøåÆœ",
        "e\u0301",  # not NFC: Qwen3's normalizer composes it
        "\u1f71",  # NFC maps it to another character
        *"ἀβγδЖщ東京日本語한국어",
        *"😀👍🏽\u200d",
        "\U00050000",  # a lead byte SmolLM2's vocabulary lacks
        "\U000e0041",
        "\uff11\uff12\uff13",  # full-width digits
        "½²",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</tool_call>",
        "<|im_start",
    ]
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_ALPHABET, min_size=0, max_size=60))
def test_chat_tokenizer_ids_equal_hf(chat_tokenizer: ChatTokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert chat_tokenizer._bpe is not None
    expected = list(chat_tokenizer._fast.encode(text, add_special_tokens=False).ids)
    assert chat_tokenizer.encode_text(text) == expected


def test_text_the_vocabulary_cannot_spell_goes_to_hf(smollm2: Path) -> None:
    spec = json.loads((smollm2 / "tokenizer.json").read_text())
    built = FastBpe._from_spec(spec, tiktoken)
    assert isinstance(built, FastBpe)
    assert built.encode("plain text") is not None
    assert built.encode("a\x04b") is None  # HF drops the byte; tiktoken would fail
    assert built.encode("plane 5: \U00050000") is None
    assert built.encode("lone \ud800 surrogate") is None
    tok = ChatTokenizer(smollm2, cache_entries=8, cache_tokens=10_000)
    hf = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    for text in ("a\x04b", "x \U00050000 y", "ok <|im_start|>user\nhi<|im_end|>"):
        assert tok.encode_text(text) == list(hf.encode(text, add_special_tokens=False).ids)


def test_nfc_tokenizer_hands_back_unnormalized_text() -> None:
    spec = json.loads((qwen3_tokenizer_dir() / "tokenizer.json").read_text())
    built = FastBpe._from_spec(spec, tiktoken)
    assert isinstance(built, FastBpe)
    assert built.encode("caf\u00e9") is not None
    assert built.encode("cafe\u0301") is None


def _changed(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(spec))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (("model", "byte_fallback"), True, "BPE options"),
        (("model", "ignore_merges"), True, "BPE options"),
        (("model", "type"), "WordPiece", "not a BPE model"),
        (("normalizer",), {"type": "NFKC"}, "normalizer NFKC"),
        (("pre_tokenizer",), {"type": "Whitespace"}, "pre-tokenizer"),
        (("added_tokens", 0, "lstrip"), True, "strip spaces"),
    ],
)
def test_shapes_it_cannot_reproduce_stay_with_hf(
    smollm2: Path, path: tuple[Any, ...], value: Any, reason: str
) -> None:
    spec = json.loads((smollm2 / "tokenizer.json").read_text())
    refused = FastBpe._from_spec(_changed(spec, path, value), tiktoken)
    assert isinstance(refused, str) and reason in refused


def test_a_malformed_file_leaves_hf_in_charge(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    byte_level = {"type": "ByteLevel", "use_regex": True}
    model = {"type": "BPE", "vocab": {}, "merges": [3]}  # a merge that is not a pair
    bad.write_text(json.dumps({"model": model, "pre_tokenizer": byte_level}))
    assert FastBpe.load(bad, lambda texts: [[] for _ in texts]) is None
    bad.write_text("{not json")
    assert FastBpe.load(bad, lambda texts: [[] for _ in texts]) is None


def test_merges_out_of_id_order_are_refused(smollm2: Path) -> None:
    spec = json.loads((smollm2 / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    assert FastBpe._from_spec(spec, tiktoken) == "ids are not in merge order"


def test_load_refuses_an_encoder_that_disagrees_on_probes(smollm2: Path) -> None:
    def wrong(texts: list[str]) -> list[list[int]]:
        return [[0] for _ in texts]

    assert FastBpe.load(smollm2 / "tokenizer.json", wrong, ["some probe"]) is None
    hf = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    assert FastBpe.load(smollm2 / "tokenizer.json", lambda t: _hf_ids(hf, t)) is not None


@pytest.mark.parametrize(
    ("missing", "inside", "outside"),
    [
        (0x04, "\x04", "\x05"),
        (0xC3, "\u00e9", "\u0100"),  # U+00C0-U+00FF start with 0xC3
        (0xE0, "\u0800", "\u1000"),
        (0xF0, "\U00010000", "\U00040000"),
        (0xF4, "\U0010ffff", "\U000fffff"),  # its range ends at the last code point
    ],
)
def test_a_missing_byte_sends_exactly_its_characters_to_hf(
    missing: int, inside: str, outside: str
) -> None:
    import re

    pattern = _missing_byte_chars(set(range(256)) - {missing})
    assert pattern is not None
    assert re.search(pattern, inside) and not re.search(pattern, outside)
    assert missing in inside.encode("utf-8") and missing not in outside.encode("utf-8")
    assert _missing_byte_chars(set(range(256)) - {0x80}) is None  # a continuation byte


def test_ascii_text_goes_to_hf_only_for_the_ascii_characters_the_vocabulary_lacks() -> None:
    import re

    class Ids:  # tiktoken's Encoding as FastBpe.encode calls it
        special_tokens_set: set[str] = set()

        def encode(self, text: str, **_: Any) -> list[int]:
            return [ord(c) for c in text]

    lacks_a = FastBpe(
        Ids(), re.compile(_missing_byte_chars(set(range(256)) - {ord("a")}) or ""), False
    )
    assert lacks_a.encode("banana") is None and lacks_a.encode("xyz") == [120, 121, 122]
    assert lacks_a.encode("\u00e0 a") is None  # the non-ASCII path finds it too
    full = FastBpe(Ids(), re.compile(_missing_byte_chars(set(range(256)) - {0xF3}) or ""), True)
    assert full.encode("banana") == [ord(c) for c in "banana"]
    assert full.encode("\U000c0000") is None  # a lead byte the vocabulary lacks
    assert full.encode("e\u0301") is None  # not NFC
