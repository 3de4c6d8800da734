"""OpenAI request bodies to engine inputs: prompts, chat templates, sampling, usage.

Pure functions over parsed JSON and a Hugging Face tokenizer (no aiohttp), so
the HTTP front stays about routes and streaming. Unknown fields are ignored;
anything malformed raises ``BadRequest``, which the front answers with an
OpenAI-shaped 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from worker.engine.sequence import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class BadRequest(ValueError):
    """Client error: answered 400 (or ``status``) with an OpenAI-shaped body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise BadRequest(f"{what} must be a list of non-negative integer token ids", param=what)
    return value


def completion_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and not any(isinstance(p, str | list) for p in prompt):
        return int_list(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest(
            "batched prompts are not supported: send one request per prompt", param="prompt"
        )
    raise BadRequest("prompt must be a non-empty string or list of token ids", param="prompt")


def message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise BadRequest("only text content parts are supported", param="messages")
        return "".join(parts)
    raise BadRequest("message content must be a string or a list of text parts", param="messages")


def render_chat_text(body: dict[str, Any], tokenizer: Any) -> str:
    """The prompt text the model sees: the folder's chat template over the messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    clean = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest("each message needs a string role", param="messages")
        clean.append({"role": msg["role"], "content": message_text(msg.get("content"))})
    kwargs = body.get("chat_template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    add_generation_prompt = body.get("add_generation_prompt", True) is not False
    try:
        return str(
            tokenizer.apply_chat_template(
                clean, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        )
    except Exception as exc:  # jinja2 raises TemplateError or anything a template raises
        raise BadRequest(f"chat template failed: {exc}", param="messages") from exc


def chat_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    # The template already wrote the special tokens; do not add a second BOS.
    return list(tokenizer.encode(render_chat_text(body, tokenizer), add_special_tokens=False))


def number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number", param=name)
    return float(value)


def sampling_params(
    body: dict[str, Any], prompt_len: int, max_model_len: int, default_max_tokens: int | None
) -> SamplingParams:
    if body.get("n", 1) not in (1, None):
        raise BadRequest("only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        # Unset means "as much as fits": the engine rejects prompt + max_tokens > context.
        room = max(1, max_model_len - prompt_len)
        max_tokens = min(default_max_tokens, room) if default_max_tokens else room
    top_k = body.get("top_k")
    seed = body.get("seed")
    stop_ids = body.get("stop_token_ids") or []
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0),
        top_p=number(body, "top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=seed,
        stop_token_ids=tuple(int_list(stop_ids, "stop_token_ids")),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    return params


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BadRequest("stop must be a string or a list of strings", param="stop")


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class Job:
    """One parsed generation request."""

    kind: str  # "chat" | "completion"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    cache_salt: str


def build_job(
    body: dict[str, Any], kind: str, prompt_ids: list[int], max_model_len: int, vocab_size: int
) -> Job:
    """Validates the rest of a request whose prompt is already tokenized."""
    if len(prompt_ids) >= max_model_len:
        raise BadRequest(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_model_len}",
            param="messages" if kind == "chat" else "prompt",
        )
    default_max = None if kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
    params = sampling_params(body, len(prompt_ids), max_model_len, default_max)
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    options = body.get("stream_options")
    salt = body.get("cache_salt")
    return Job(
        kind=kind,
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        params=params,
        stop=stop_strings(body),
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        cache_salt=salt if isinstance(salt, str) else "",
    )
