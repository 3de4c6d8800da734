"""Incremental tokenization of multi-turn chats: reuse the ids of an earlier turn's prefix.

A rendered chat is a run of messages, each opening with a special *marker*
token (``<|im_start|>`` for ChatML). Special tokens are split out before the
tokenizer's pre-tokenizer runs, so the ids of the text before a marker never
depend on what follows it: ``encode(text) == encode(text[:p]) + encode(text[p:])``
whenever ``text[p:]`` starts with the marker. This module remembers the ids of
such prefixes (keyed by a 128-bit digest of the prefix text) and, for a new
request, tokenizes only the suffix after the longest remembered one.

The cache is a bounded LRU (entries and total tokens). ``ChatTokenizer``
checks on load that the split identity holds for its tokenizer and turns the
cache off when it does not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

# How many markers from the end to try; a follow-up turn hits at the third.
_MAX_PROBES = 8
# Prefixes remembered per request: before the generation prompt and before the last message.
_REMEMBER = 2


@dataclass(frozen=True)
class Plan:
    """How to tokenize one text: reuse ``prefix_ids``, tokenize ``text[cut:]``."""

    prefix_ids: list[int]
    cut: int


def _key(prefix: str) -> bytes:
    return xxhash.xxh3_128_digest(prefix.encode("utf-8", "surrogatepass"))


class PrefixTokenCache:
    """Remembers token ids of marker-aligned text prefixes (bounded LRU)."""

    def __init__(
        self, marker: str, marker_id: int, *, max_entries: int = 1024, max_tokens: int = 8_000_000
    ) -> None:
        if not marker:
            raise ValueError("marker must be a non-empty special token string")
        self.marker = marker
        self.marker_id = marker_id
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, list[int]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def plan(self, text: str) -> Plan:
        """The longest remembered marker-aligned prefix of ``text`` (or none)."""
        end = len(text)
        for _ in range(_MAX_PROBES):
            p = text.rfind(self.marker, 0, end)
            if p <= 0:
                break
            key = _key(text[:p])
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return Plan(ids, p)
            end = p
        self.misses += 1
        return Plan([], 0)

    def remember(self, text: str, ids: list[int]) -> None:
        """Stores the ids of the last ``_REMEMBER`` marker-aligned prefixes of ``text``."""
        if self.max_entries <= 0:
            return
        end, id_end = len(text), len(ids)
        for _ in range(_REMEMBER):
            p = text.rfind(self.marker, 0, end)
            if p <= 0:
                return
            # The marker at text position p is the last marker id before id_end.
            i = id_end - 1
            while i >= 0 and ids[i] != self.marker_id:
                i -= 1
            if i <= 0:
                return
            self._put(_key(text[:p]), ids[:i])
            end, id_end = p, i

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """``encode(text)``, reusing and then remembering marker-aligned prefixes."""
        plan = self.plan(text)
        ids = plan.prefix_ids + encode(text[plan.cut :])
        self.remember(text, ids)
        return ids

    def _put(self, key: bytes, ids: list[int]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
        if len(ids) > self.max_tokens:
            return
        self._entries[key] = ids
        self._tokens += len(ids)
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted)
