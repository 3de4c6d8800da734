"""Incremental tokenization of plain completion prompts that share text with earlier ones.

Agents, RAG and replayed conversations send ``/v1/completions`` prompts that
repeat long stretches of earlier prompts. Chats are split at message markers
(``gateway.text.prefix_tokens``); a plain prompt has none, so this module cuts
it at word boundaries instead.

Why a word boundary is safe: the byte-level BPE tokenizers of Llama 3, Qwen,
GPT-2 and SmolLM pre-split text with a regex, left to right, and BPE never
merges across those pieces. Each piece ends at the first character its
pattern cannot take, so a piece that ends before ``" word"`` (a space between
a non-space and a letter) or after ``"\\n"`` followed by a non-space ends there
whatever follows; the ids of everything before such a *cut* are those of the
text before it, and the text after it tokenizes the same on its own.
``encode(text) == encode(text[:p]) + encode(text[p:])``. ``ChatTokenizer``
checks that identity on probe texts when it loads a tokenizer and turns this
cache off where it fails (SentencePiece ``Metaspace`` tokenizers, say).
A cut is also only taken where the remembered encoding has a token starting
exactly there, right after one that ends there (never inside an added token).

What is remembered: for each prompt, its ids once, and for every
``ANCHOR_CHARS`` of its text a key (a chained 128-bit digest of the text up to
that anchor) naming the last cut before the anchor. A new prompt digests its
own anchors the same way and reuses the ids up to the cut of its longest
remembered anchor, then tokenizes only the rest. Bounded LRU over prompts
(entries and total tokens); ids are kept as 4-byte arrays.

Where a tokenizer's ids also split at word starts, ``ChatTokenizer`` picks
each anchor's cut among word starts (``anchor_word_starts``) and encodes the
pieces between them in one batch call: each cut's token count is then the
pieces' ids before it, with no character offsets computed (``remember_at``).
Otherwise the cuts come from the encoding's spans (``remember``).
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

# Text between two anchors: a shared prefix is found to within this many characters.
ANCHOR_CHARS = 256
# How far back from an anchor to look for a cut, in characters.
_CUT_SEARCH_CHARS = 256


class Spans(Protocol):
    """Token <-> character maps of one tokenization (a ``tokenizers.Encoding`` is one)."""

    def __len__(self) -> int: ...
    def char_to_token(self, char_pos: int) -> int | None: ...
    def token_to_chars(self, token_index: int) -> tuple[int, int] | None: ...


def ids_before(spans: Spans, p: int) -> int | None:
    """How many tokens precede character ``p``, if a token starts exactly there right
    after one that ends there (so ``p`` is not inside a token or an added token)."""
    i = spans.char_to_token(p)
    if i is None or i == 0:
        return None
    here, before = spans.token_to_chars(i), spans.token_to_chars(i - 1)
    if here is None or before is None or here[0] != p or before[1] != p or before[0] >= p:
        return None
    return i


def is_cut(text: str, p: int) -> bool:
    """Whether ``text[p:]`` starts a new pre-tokenizer piece whatever precedes it (see above)."""
    if p <= 0 or p >= len(text) - 1:
        return False
    c = text[p]
    before = text[p - 1]
    if before == "\n":
        return not c.isspace()
    return c == " " and not before.isspace() and text[p + 1].isalpha()


def is_word_start(text: str, p: int) -> bool:
    """Whether ``text[p:]`` starts with a space and a letter right after a non-space.

    A stricter cut than ``is_cut``: text on *both* sides encodes on its own. At a
    line start the text before ends in whitespace, which a pre-tokenizer joins
    with what follows differently ("\\t\\r\\n" + "ff" is not "\\t\\r\\nff").
    """
    return (
        0 < p < len(text) - 1
        and text[p] == " "
        and text[p + 1].isalpha()
        and not text[p - 1].isspace()
    )


def split_at_word_starts(text: str, parts: int) -> list[str]:
    """``text`` in up to ``parts`` pieces of about equal length, each after the first
    starting at a word start (``is_word_start``).

    Where a tokenizer's ids split at every word start (``ChatTokenizer`` checks that
    on a probe), encoding the pieces apart and joining their ids gives the ids of
    the whole, so the pieces can be encoded in parallel. A piece with no word start
    within the next piece's length (text without spaces) stays joined to it.
    """
    size = len(text) // max(1, parts)
    bounds = [0]
    for i in range(1, parts):
        p = max(bounds[-1] + 1, size * i)
        limit = min(len(text), p + size)
        while p < limit and not is_word_start(text, p):
            p += 1
        if p < limit:
            bounds.append(p)
    bounds.append(len(text))
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


class JoinedSpans:
    """Ids and ``Spans`` of a text encoded in pieces (``split_at_word_starts``), as one.

    Each query goes to the piece that holds the character or token, shifted by
    where that piece starts, so it answers exactly as that piece's own
    ``Encoding`` does; where the pieces' ids join up to the whole text's (the
    tokenizer's probe check), so do their character spans.
    """

    def __init__(self, pieces: Sequence[Any], texts: Sequence[str]) -> None:
        self._pieces = list(pieces)
        self._char_starts = list(itertools.accumulate((len(t) for t in texts), initial=0))
        self._token_starts = list(itertools.accumulate((len(p) for p in pieces), initial=0))
        self.ids = [i for piece in pieces for i in piece.ids]

    def __len__(self) -> int:
        return len(self.ids)

    def char_to_token(self, char_pos: int) -> int | None:
        k = bisect.bisect_right(self._char_starts, char_pos) - 1
        if not 0 <= k < len(self._pieces):
            return None
        i = self._pieces[k].char_to_token(char_pos - self._char_starts[k])
        return None if i is None else int(i) + self._token_starts[k]

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None:
        k = bisect.bisect_right(self._token_starts, token_index) - 1
        if not 0 <= k < len(self._pieces):
            return None
        span = self._pieces[k].token_to_chars(token_index - self._token_starts[k])
        if span is None:
            return None
        shift = self._char_starts[k]
        return span[0] + shift, span[1] + shift


def anchor_word_starts(text: str, start: int, anchors: int) -> list[tuple[int, int]]:
    """(anchor index, word start) for each of the first ``anchors`` anchors that has a
    word start (``is_word_start``) after ``start`` in the window ``remember`` searches
    for a cut. Word starts are cuts too, and text split there encodes piece by piece
    (where the tokenizer's probe check holds): ``ChatTokenizer`` encodes a prompt's
    pieces between them and knows each cut's token count without character spans."""
    found: list[tuple[int, int]] = []
    for k in range(anchors):
        anchor = (k + 1) * ANCHOR_CHARS
        for p in range(anchor - 2, max(start, anchor - _CUT_SEARCH_CHARS), -1):
            if is_word_start(text, p):
                found.append((k, p))
                break
    return found


def anchor_keys(text: str) -> list[bytes]:
    """The chained digest of ``text[:k * ANCHOR_CHARS]`` for k = 1, 2, ... (whole anchors)."""
    keys: list[bytes] = []
    digest = b""
    for end in range(ANCHOR_CHARS, len(text) + 1, ANCHOR_CHARS):
        chunk = text[end - ANCHOR_CHARS : end].encode("utf-8", "surrogatepass")
        digest = xxhash.xxh3_128_digest(digest + chunk)
        keys.append(digest)
    return keys


@dataclass
class _Remembered:
    """One prompt's ids and the anchor keys that point at them."""

    slot: int
    ids: array
    keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class PromptPlan:
    """Reuse ``prefix_ids`` (the ids of ``text[:cut]``), tokenize ``text[cut:]``."""

    prefix_ids: list[int]
    cut: int
    keys: list[bytes]  # the text's anchor keys, for remembering it afterwards


class PromptPrefixCache:
    """Remembers token ids of plain prompts at word-boundary cuts (bounded LRU)."""

    def __init__(self, *, max_entries: int = 4096, max_tokens: int = 8_000_000) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[int, _Remembered] = OrderedDict()
        self._anchors: dict[bytes, tuple[_Remembered, int, int]] = {}  # key -> (prompt, n, cut)
        self._tokens = 0
        self._next_slot = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def plan(self, text: str) -> PromptPlan:
        """The ids of the longest remembered cut-aligned prefix of ``text`` (or none)."""
        keys = anchor_keys(text)
        for key in reversed(keys):
            found = self._anchors.get(key)
            if found is not None:
                remembered, n, cut = found
                self._prompts.move_to_end(remembered.slot)
                self.hits += 1
                self.reused_tokens += n
                return PromptPlan(remembered.ids[:n].tolist(), cut, keys)
        self.misses += 1
        return PromptPlan([], 0, keys)

    def remember(
        self, text: str, ids: list[int], spans: Spans, keys: list[bytes], *, shift: int = 0
    ) -> None:
        """Stores ``ids`` (the whole prompt's) under each anchor that has a cut before it.

        ``spans`` maps characters of ``text[shift:]`` to the last ``spans``-many
        ids and back (the ids before them, a reused prefix, need none).
        """
        if self.max_entries <= 0 or not keys or len(ids) > self.max_tokens:
            return
        skip = len(ids) - len(spans)
        entries: list[tuple[bytes, int, int]] = []
        for k, key in enumerate(keys):
            # The cut's next character must lie inside the anchor too (``is_cut`` reads it).
            anchor = (k + 1) * ANCHOR_CHARS
            for p in range(anchor - 2, max(shift, anchor - _CUT_SEARCH_CHARS), -1):
                if is_cut(text, p):
                    n = ids_before(spans, p - shift)
                    if n is not None:
                        entries.append((key, skip + n, p))
                        break
        self._store(ids, entries)

    def remember_at(
        self, ids: list[int], keys: list[bytes], cuts: Sequence[tuple[int, int, int]]
    ) -> None:
        """Stores ``ids`` (the whole prompt's) under anchors whose cuts are known:
        ``cuts`` holds (anchor index into ``keys``, ids before the cut, the cut)."""
        if self.max_entries <= 0 or not keys or len(ids) > self.max_tokens:
            return
        self._store(ids, [(keys[k], n, p) for k, n, p in cuts])

    def _store(self, ids: list[int], entries: list[tuple[bytes, int, int]]) -> None:
        if not entries:
            return
        self._next_slot += 1
        remembered = _Remembered(self._next_slot, array("i", ids))
        self._prompts[remembered.slot] = remembered
        self._tokens += len(ids)
        for key, n, cut in entries:
            self._anchors[key] = (remembered, n, cut)
            remembered.keys.append(key)
        while len(self._prompts) > self.max_entries or self._tokens > self.max_tokens:
            _, evicted = self._prompts.popitem(last=False)
            self._tokens -= len(evicted.ids)
            for key in evicted.keys:
                found = self._anchors.get(key)
                if found is not None and found[0] is evicted:
                    del self._anchors[key]
