"""Incremental tokenization of multi-turn chats: reuse the ids of an earlier turn's prefix.

A rendered chat is a run of messages, each opening with a special *marker*
token (``<|im_start|>`` for ChatML). Special tokens are split out before the
tokenizer's pre-tokenizer runs, so the ids of the text before a marker never
depend on what follows it: ``encode(text) == encode(text[:p]) + encode(text[p:])``
whenever ``text[p:]`` starts with the marker. This module remembers the ids of
such prefixes (keyed by a 128-bit digest of the prefix text) and, for a new
request, tokenizes only the suffix after the longest remembered one.

Each remembered prefix also memoizes its block-hash chain per hash spec, so a
follow-up turn hashes only its new blocks (``Prompt.block_hashes``).

The cache is a bounded LRU (entries and total tokens). ``ChatTokenizer``
checks on load that the split identity holds for its tokenizer and turns the
cache off when it does not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from contract.hashing import HashSpec, block_hashes, extend_block_hashes

# How many markers from the end to try; a follow-up turn hits at the second or third.
_MAX_PROBES = 8
# Prefixes remembered per request: before the generation prompt and before the last message.
_REMEMBER = 2


@dataclass
class PrefixEntry:
    """The ids of one remembered text prefix, and its block-hash chain per spec."""

    ids: list[int]
    chains: dict[HashSpec, list[int]] = field(default_factory=dict)


@dataclass
class Prompt:
    """A tokenized prompt, with the cache entries it reused and refreshed."""

    ids: list[int]
    reused: PrefixEntry | None = None  # ids[: len(reused.ids)] came from this entry
    stored: list[PrefixEntry] = field(default_factory=list)  # prefixes of ids now remembered
    text: str | None = None  # the rendered chat the ids encode (None: not a chat)

    def block_hashes(self, spec: HashSpec) -> list[int]:
        """The chain of ``ids`` under ``spec``, hashing only blocks past the reused prefix."""
        base = self.reused.chains.get(spec) if self.reused is not None else None
        if base:
            chain = base + extend_block_hashes(base, self.ids, spec)
        else:
            chain = block_hashes(self.ids, spec)
        for entry in self.stored:
            entry.chains.setdefault(spec, chain[: len(entry.ids) // spec.block_size])
        return chain


@dataclass(frozen=True)
class Plan:
    """How to tokenize one text: reuse ``entry``'s ids, tokenize ``text[cut:]``."""

    entry: PrefixEntry | None
    cut: int

    @property
    def prefix_ids(self) -> list[int]:
        return self.entry.ids if self.entry is not None else []


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
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0  # token ids taken from entries instead of tokenized

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
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.reused_tokens += len(entry.ids)
                return Plan(entry, p)
            end = p
        self.misses += 1
        return Plan(None, 0)

    def remember(self, text: str, ids: list[int]) -> list[PrefixEntry]:
        """Stores the ids of the last ``_REMEMBER`` marker-aligned prefixes of ``text``."""
        stored: list[PrefixEntry] = []
        if self.max_entries <= 0:
            return stored
        end, id_end = len(text), len(ids)
        for _ in range(_REMEMBER):
            p = text.rfind(self.marker, 0, end)
            if p <= 0:
                break
            # The marker at text position p is the last marker id before id_end.
            i = id_end - 1
            while i >= 0 and ids[i] != self.marker_id:
                i -= 1
            if i <= 0:
                break
            entry = self._put(_key(text[:p]), ids, i)
            if entry is not None:
                stored.append(entry)
            end, id_end = p, i
        return stored

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> Prompt:
        """``encode(text)``, reusing and then remembering marker-aligned prefixes."""
        plan = self.plan(text)
        ids = plan.prefix_ids + encode(text[plan.cut :])
        return Prompt(ids, plan.entry, self.remember(text, ids))

    def _put(self, key: bytes, ids: list[int], n: int) -> PrefixEntry | None:
        old = self._entries.get(key)
        if old is not None and len(old.ids) == n:
            self._entries.move_to_end(key)  # same text, same ids: keep its chains
            return old
        if old is not None:
            self._tokens -= len(old.ids)
            del self._entries[key]
        if n > self.max_tokens:
            return None
        entry = PrefixEntry(ids[:n])
        self._entries[key] = entry
        self._tokens += n
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted.ids)
        return entry if key in self._entries else None
