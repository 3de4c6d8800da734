"""The OpenAI request and response shapes: parsing with validation, and builders.

Parsing turns a decoded JSON body into a frozen dataclass or raises
``APIError(400)`` naming the offending parameter; nothing here touches the
network or the tokenizer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from gateway.edge.errors import APIError

MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class SamplingRequest:
    """Options shared by chat and text completions."""

    model: str
    max_tokens: int | None = None  # None: whatever the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class ChatRequest:
    sampling: SamplingRequest
    messages: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class CompletionRequest:
    sampling: SamplingRequest
    prompt: str | tuple[int, ...]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if value < lo or (hi is not None and value > hi):
        raise _bad(f"'{name}' must be >= {lo}" + (f" and <= {hi}" if hi else ""), name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def parse_sampling(body: Any) -> SamplingRequest:
    """The shared options of a chat or completion body; ``APIError(400)`` when invalid."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", "n")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        if len(stop_raw) > MAX_STOP_STRINGS:
            raise _bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        stop = tuple(s for s in stop_raw if s)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        include_usage = _bool(options, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    return SamplingRequest(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_int(body, "top_k", 0, 2**32 - 1) or 0,
        seed=None if seed is None else seed % 2**64,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        user=user or None,
        ignore_eos=_bool(body, "ignore_eos"),
    )


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad("only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad("message content must be a string or a list of text parts", where)


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` body."""
    sampling = parse_sampling(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    messages = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", where)
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise _bad("each message needs a string 'role'", f"{where}.role")
        content = msg.get("content")
        text = "" if content is None else _content_text(content, f"{where}.content")
        # Passed to the template exactly as the worker's own front passes it, so ids match.
        messages.append({"role": role, "content": text})
    return ChatRequest(sampling, tuple(messages))


def parse_completion(body: Any) -> CompletionRequest:
    """A ``/v1/completions`` body (one prompt: a string or a list of token ids)."""
    sampling = parse_sampling(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        return CompletionRequest(sampling, prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return CompletionRequest(sampling, tuple(prompt))
    raise _bad("'prompt' must be a non-empty string or list of token ids (one prompt)", "prompt")


# -- responses -------------------------------------------------------------------------


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_response(
    rid: str, model: str, text: str, finish: str, usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage,
    }


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
) -> dict[str, Any]:
    choice = (
        None
        if delta is None
        else {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    )
    return _stream_chunk(
        rid, "chat.completion.chunk", model, created, choice, usage, with_usage_field
    )


def completion_response(
    rid: str, model: str, text: str, finish: str, usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish: str | None,
    usage: dict[str, Any] | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    choice = (
        None
        if text is None
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    )
    return _stream_chunk(rid, "text_completion", model, created, choice, usage, with_usage_field)
