"""A byte-level BPE tokenizer's ids through tiktoken's encoder, where that gives HF's ids.

Why: on a cold 4k-token text Hugging Face ``tokenizers`` spent 3.4 ms of CPU
and tiktoken's encoder 0.64 ms with the same vocabulary (5.3x less), and a
long cold prompt's tokenizing was most of the gateway's cost per request.

The two encoders run BPE differently: HF merges the adjacent pair with the
lowest *merge* rank, tiktoken the adjacent pair whose *concatenation* has the
lowest rank. Given ranks equal to ids and ids in merge order (checked when the
file is read), they pick the same pair except where an adjacent pair that is
not a merge concatenates to a token. On SmolLM2's and Qwen3's vocabularies
no text has been found where that happens (every vocabulary token as a text,
2,000 Python sources, 200k random mixed-script strings, 300k concatenations
of vocabulary tokens: no difference; ``tests/gateway/test_fast_bpe.py`` keeps
a whole-vocabulary check and a property test). ``FastBpe.load`` also compares
both on probe texts and a sample of the vocabulary at start-up, and takes only
the tokenizer shapes it can reproduce exactly; anything else stays with HF.

Per text, what tiktoken cannot reproduce goes back to HF: a character whose
UTF-8 bytes include one the vocabulary lacks (HF drops such a byte, tiktoken
would fail), a lone surrogate, or text a normalizer would change.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The ByteLevel pre-tokenizer's own split (``use_regex: true``): GPT-2's pattern.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Vocabulary tokens sampled for the start-up comparison (all of them take ~1 s on Qwen3).
_VOCAB_SAMPLE = 2000

EncodeBatch = Callable[[list[str]], list[list[int]]]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_STAND_INS = {ord(c): chr(b) for c, b in _byte_decoder().items()}


def _to_bytes(token: str) -> bytes:
    """A byte-level token's bytes (UnicodeEncodeError if it is not one)."""
    return token.translate(_STAND_INS).encode("latin-1")


def _split_pattern(pre: Any) -> str | None:
    """The regex a supported pre-tokenizer splits on, or None."""
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel":
        return _GPT2_SPLIT if pre.get("use_regex", True) else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = pre["pretokenizers"]
    regex = split.get("pattern", {}).get("Regex") if split.get("type") == "Split" else None
    if (
        regex is None
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
    ):
        return None
    return str(regex)


def _missing_byte_chars(have: set[int]) -> str | None:
    """A regex class of the characters whose UTF-8 bytes the vocabulary lacks.

    None when a continuation byte is missing (any non-ASCII text could need it).
    """
    ranges: list[str] = [r"\ud800-\udfff"]  # lone surrogates: not UTF-8 at all
    for b in sorted(set(range(256)) - have):
        if b < 0x80:
            ranges.append(re.escape(chr(b)))
        elif b < 0xC0:
            return None
        elif b in (0xC0, 0xC1) or b >= 0xF5:
            continue  # never in UTF-8
        else:  # a lead byte: every code point it starts
            if b < 0xE0:
                low, span = (b & 0x1F) << 6, 1 << 6
            elif b < 0xF0:
                low, span = (b & 0x0F) << 12, 1 << 12
            else:
                low, span = (b & 0x07) << 18, 1 << 18
            low = max(low, {0xE0: 0x800, 0xF0: 0x10000}.get(b, 0))
            high = min(low | (span - 1), sys.maxunicode)  # 0xF4 starts only up to U+10FFFF
            ranges.append(f"{re.escape(chr(low))}-{re.escape(chr(high))}")
    return "[" + "".join(ranges) + "]"


class FastBpe:
    """Ids of texts (no special tokens added) from tiktoken, or None for HF to encode."""

    def __init__(self, encoding: Any, needs_hf: re.Pattern[str], nfc: bool) -> None:
        self._encoding = encoding
        self._needs_hf = needs_hf
        self._nfc = nfc
        self._specials = encoding.special_tokens_set
        # ASCII text (always NFC) only needs HF for the ASCII characters the vocabulary
        # lacks: deleting every other one from its bytes takes 1 us on a small chat,
        # the search over every class 7-11 us.
        self._ascii_spelled = bytes(c for c in range(128) if not needs_hf.search(chr(c)))

    @classmethod
    def load(
        cls, tokenizer_json: Path, reference: EncodeBatch, probes: Sequence[str] = ()
    ) -> FastBpe | None:
        """The fast encoder for this ``tokenizer.json``, or None where it is not exact.

        ``reference`` is HF's own batch encoder (ids, no special tokens added); it
        and tiktoken must agree on ``probes`` and a sample of the vocabulary.
        """
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            spec = json.loads(Path(tokenizer_json).read_text())
        except (OSError, ValueError):
            return None
        try:
            built = cls._from_spec(spec, tiktoken)
        except Exception as exc:  # a tokenizer.json shaped in a way not foreseen here
            built = f"unreadable tokenizer.json: {type(exc).__name__}: {exc}"
        if isinstance(built, str):
            logger.info("tokenizing with HF tokenizers only: %s", built)
            return None
        texts = [*probes, *built.sample_texts(spec)]
        for text, expected in zip(texts, reference(texts), strict=True):
            got = built.encode(text)  # None: this text would go to HF anyway
            if got is not None and got != expected:
                logger.warning("tokenizing with HF only: tiktoken's ids differ on %r", text[:40])
                return None
        return built

    @classmethod
    def _from_spec(cls, spec: dict[str, Any], tiktoken: Any) -> FastBpe | str:
        """The encoder, or why this tokenizer's shape is not supported."""
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            return "not a BPE model"
        if (
            model.get("dropout")
            or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix")
            or model.get("byte_fallback")
            or model.get("ignore_merges")
        ):
            return "BPE options tiktoken does not have"
        normalizer = spec.get("normalizer")
        if normalizer is not None and normalizer.get("type") != "NFC":
            return f"normalizer {normalizer.get('type')}"
        pattern = _split_pattern(spec.get("pre_tokenizer"))
        if pattern is None:
            return "pre-tokenizer is not byte-level BPE's"
        added = spec.get("added_tokens") or []
        contents = [a["content"] for a in added]
        if any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") for a in added):
            return "added tokens that strip spaces or match whole words"
        if normalizer is not None and any(a.get("normalized") for a in added):
            return "added tokens matched after normalizing"
        if any(a != b and b.startswith(a) for a in contents for b in contents):
            return "an added token is a prefix of another"
        bytes_of = _byte_decoder()
        vocab: dict[str, int] = model.get("vocab") or {}
        ranks = {bytes([bytes_of[t]]): i for t, i in vocab.items() if t in bytes_of}
        last = -1
        try:
            for merge in model.get("merges") or []:
                left, right = merge.split(" ") if isinstance(merge, str) else merge
                token = _to_bytes(left + right)
                i = vocab[left + right]
                if token in ranks or i < last:
                    return "ids are not in merge order"
                ranks[token] = last = i
        except (KeyError, UnicodeEncodeError, ValueError):
            return "merges that are not byte-level tokens"
        needs_hf = _missing_byte_chars({t[0] for t in ranks if len(t) == 1})
        if needs_hf is None:
            return "the vocabulary lacks a UTF-8 continuation byte"
        specials = {a["content"]: int(a["id"]) for a in added}
        try:
            encoding = tiktoken.Encoding(
                "kvroute", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as exc:  # tiktoken refuses the pattern or the ids
            return f"tiktoken: {exc}"
        return cls(encoding, re.compile(needs_hf), normalizer is not None)

    def sample_texts(self, spec: dict[str, Any]) -> list[str]:
        """Every n-th vocabulary token as text, and runs of them with added tokens between."""
        tokens = list((spec.get("model") or {}).get("vocab") or {})
        step = max(1, len(tokens) // _VOCAB_SAMPLE)
        texts = []
        for tok in tokens[::step]:
            try:
                texts.append(_to_bytes(tok).decode("utf-8", errors="replace"))
            except UnicodeEncodeError:
                continue
        added = [a["content"] for a in spec.get("added_tokens") or []][:8]
        runs = ["".join(texts[i : i + 5]) for i in range(0, len(texts), 5)]
        return [*texts, *(r + added[i % len(added)] + r for i, r in enumerate(runs) if added)]

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids, added tokens included; None where HF must encode it."""
        if text.isascii():
            if text.encode("ascii").translate(None, self._ascii_spelled):
                return None
        elif self._needs_hf.search(text) or (
            self._nfc and not unicodedata.is_normalized("NFC", text)
        ):
            return None
        ids: list[int] = self._encoding.encode(
            text, allowed_special=self._specials, disallowed_special=()
        )
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]] | None:
        """Each text's ids, or None if any of them needs HF."""
        out = []
        for text in texts:
            ids = self.encode(text)
            if ids is None:
                return None
            out.append(ids)
        return out
