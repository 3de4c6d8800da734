"""Streaming detokenization and stop strings for one generated sequence.

Token ids arrive a few at a time; text must come out as soon as it is
final. Decoding only the new ids would break characters whose UTF-8 bytes
span two tokens, and words whose leading space depends on the previous
token, so each step decodes a short window of earlier ids with and without
the new ones and emits the difference, holding back while the tail is an
incomplete character (U+FFFD). Stop strings are matched on the text: the
text up to the first match is emitted, never the stop string itself, and
text that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt ids used as left context for the first decode


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self.text = ""  # all text decoded so far (before stop truncation)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False  # a stop string matched; no more text will come

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds generated ids; returns the text that is now final (maybe "")."""
        if self.stopped:
            return ""
        for token in new_ids:
            self._ids.append(token)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if full.endswith(_REPLACEMENT) or len(full) < len(prefix):
                continue  # an incomplete character: wait for its remaining bytes
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation ended (flushes held-back text)."""
        if self.stopped:
            return ""
        tail_ids = self._ids[self._read_offset :]
        if tail_ids:
            # Bytes that never completed a character: decode them as they are.
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            # A match can start at most max(len(stop)) - 1 characters before the new text.
            start = max(0, self._emitted - max(len(s) for s in self._stop) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped = True
                out = self.text[self._emitted : cut] if cut > self._emitted else ""
                self._emitted = max(self._emitted, cut)
                return out
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    @property
    def output_text(self) -> str:
        """Everything emitted so far: the completion as the client sees it."""
        return self.text[: self._emitted]
