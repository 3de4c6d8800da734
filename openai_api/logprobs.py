"""Log-probabilities in OpenAI's two shapes, from token ids and values the engine reported.

A worker reports, per generated token, its log-probability and the top ``k``
alternatives as token ids (``TokenLogprobs``); the front that holds the
tokenizer turns them into text here. A token's text is the tokenizer's decoding
of that one id (as vLLM reports it); ``bytes`` are its UTF-8 bytes.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
  "text_offset"}``
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Decode = Callable[[int], str]


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token: its id, log-probability and likeliest alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def decoder(tokenizer: Any) -> Decode:
    """Token id -> its text, memoized (the same ids recur across a response)."""
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = str(tokenizer.decode([token_id], skip_special_tokens=False))
            cache[token_id] = text
        return text

    return decode


def _entry(decode: Decode, token_id: int, logprob: float) -> dict[str, Any]:
    text = decode(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: Sequence[TokenLogprobs], decode: Decode, top_n: int) -> dict[str, Any]:
    """The ``choices[].logprobs`` object of a chat completion (or one stream chunk)."""
    content = []
    for it in items:
        entry = _entry(decode, it.token_id, it.logprob)
        entry["top_logprobs"] = [_entry(decode, t, v) for t, v in it.top[:top_n]]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    items: Sequence[TokenLogprobs], decode: Decode, top_n: int, offset: int = 0
) -> dict[str, Any]:
    """The ``choices[].logprobs`` object of a text completion; ``offset`` of the first token."""
    tokens, values, tops, offsets = [], [], [], []
    for it in items:
        text = decode(it.token_id)
        tokens.append(text)
        values.append(it.logprob)
        tops.append({decode(t): v for t, v in it.top[:top_n]} if top_n else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
