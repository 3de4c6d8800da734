"""Token ids to text, one step at a time: incremental detokenization and stop strings.

``Detokenizer`` decodes only a small window of recent tokens each step and
holds text back while it ends in an incomplete UTF-8 character (the tokenizer
renders those as U+FFFD), so a multi-byte character split across tokens comes
out whole. ``TextStream`` adds stop strings on top: it never emits a prefix of
a stop string that may still complete, and cuts the text where one matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoding of one sequence's generated tokens."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # Text of token_ids[:read_offset] is emitted; token_ids[prefix_offset:read_offset]
        # is re-decoded as context so spaces and merges at the boundary come out right.
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens))

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds tokens; returns the newly complete text (may be empty)."""
        self.token_ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta


class TextStream:
    """Detokenizes and applies stop strings; ``stopped`` turns True at the first match."""

    def __init__(
        self, tokenizer: Any, stop: Sequence[str] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self.detokenizer = Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""
        self.text = ""  # everything emitted so far
        self.stopped = False

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds generated tokens; returns the text that is safe to send now."""
        if self.stopped:
            return ""
        return self._emit(self.detokenizer.push(new_ids), final=False)

    def flush(self) -> str:
        """At the end of generation: releases whatever was held back."""
        if self.stopped:
            return ""
        return self._emit(self.detokenizer.flush(), final=True)

    def _emit(self, delta: str, *, final: bool) -> str:
        self._pending += delta
        if self.stop:
            # Only the pending text can hold a new match: emitted text never ends
            # in more than the held-back length of any stop string's prefix.
            cut = min((i for i in (self._pending.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                out = self._pending[:cut]
                self._pending = ""
                self.stopped = True
                self.text += out
                return out
        if final or self._hold == 0:
            out, self._pending = self._pending, ""
        elif len(self._pending) > self._hold:
            out, self._pending = self._pending[: -self._hold], self._pending[-self._hold :]
        else:
            out = ""
        self.text += out
        return out
