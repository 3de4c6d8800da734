"""OpenAI response bodies and stream chunks, as every kvroute HTTP front sends them."""

from __future__ import annotations

import time
from typing import Any


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_choice(
    index: int,
    text: str | None,
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One chat choice; with ``tool_calls`` the message carries them (content may be None)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def completion_choice(
    index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _response(
    obj: str, rid: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chat_response(
    rid: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """A chat completion; ``choices`` from ``chat_choice``."""
    return _response("chat.completion", rid, model, choices, usage)


def _stream_chunk(
    rid: str,
    obj: str,
    model: str,
    created: int,
    choice: dict[str, Any] | None,
    usage: dict[str, Any] | None,
    with_usage_field: bool,
) -> dict[str, Any]:
    """One SSE chunk; ``choice`` None makes the usage-only chunk (empty ``choices``)."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [] if choice is None else [choice],
    }
    if with_usage_field:
        chunk["usage"] = usage
    return chunk


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish: str | None,
    usage: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = (
        None
        if delta is None
        else {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    )
    return _stream_chunk(
        rid, "chat.completion.chunk", model, created, choice, usage, with_usage_field
    )


def completion_response(
    rid: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """A text completion; ``choices`` from ``completion_choice``."""
    return _response("text_completion", rid, model, choices, usage)


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish: str | None,
    usage: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = (
        None
        if text is None
        else {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    )
    return _stream_chunk(rid, "text_completion", model, created, choice, usage, with_usage_field)
