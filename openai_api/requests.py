"""OpenAI request bodies: parsing with validation, the one parser of every kvroute front.

Parsing turns a decoded JSON body into a frozen dataclass or raises
``APIError(400)`` naming the offending parameter; nothing here touches the
network or the tokenizer. The gateway's edge and a worker's own HTTP front
both call these functions, so a body means the same thing on either.

Defaults follow OpenAI and vLLM: ``/v1/completions`` generates 16 tokens when
``max_tokens`` is unset, chat generates as much as the context leaves.
``top_p=0`` is the limit of nucleus sampling, the single most likely token:
it is parsed as greedy (temperature 0), never passed on as "unset".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from openai_api.errors import APIError
from openai_api.options import reject_unsupported
from openai_api.tools import Tools, constraint, parse_tools

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer holds back this much text
MAX_MESSAGES = 4096  # per chat request: parsing and templating stay short on the loop
MAX_CHOICES = 16  # n: choices per request
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
ENGINE_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "logprobs",
    "json_schema",
    "grammar",
)
MAX_TOKEN_ID = 2**32  # token ids travel as uint32 (proto); anything larger is a 400 here


@dataclass(frozen=True)
class SamplingRequest:
    """Options shared by chat and text completions."""

    model: str  # "" when the body names none: the front's served model
    n: int = 1  # choices, each its own generation sharing the prompt's blocks
    max_tokens: int | None = None  # None: whatever the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, not only the last
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None  # honoured only where the caller is trusted (see fronts)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    logprobs: int | None = None  # None: off; k: the chosen token's and the top k alternatives
    include_stop_str_in_output: bool = False  # a matched stop string ends the text (vLLM)
    json_schema: str | None = None  # response_format json_object / json_schema, as JSON text
    grammar: str | None = None  # a forced tool call: a llguidance Lark grammar (openai_api.tools)

    def engine_options(self) -> dict[str, Any]:
        """What every engine is told besides the prompt and ``max_tokens``: the one list of
        sampling fields the gateway's ``Generation`` and the worker's ``SamplingParams`` share."""
        return {name: getattr(self, name) for name in ENGINE_OPTIONS}


@dataclass(frozen=True)
class ChatRequest:
    sampling: SamplingRequest
    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool = True
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs, as sorted pairs
    tools: Tools | None = None  # tools and tool_choice (None: no tool offered)

    def template_args(self) -> dict[str, Any]:
        """Keyword arguments of ``apply_chat_template`` besides the messages, the same on
        every front: ``chat_template_kwargs`` and the tools."""
        args = dict(self.template_kwargs)
        if self.tools is not None:
            args["tools"] = [dict(t) for t in self.tools.tools]
        return args

    def with_tool_format(self, tool_format: str) -> ChatRequest:
        """This request with a forced tool call's constraint on its sampling, for a chat
        template that writes calls in ``tool_format`` (``openai_api.tools``)."""
        json_schema, grammar = constraint(self.tools, tool_format)
        if json_schema is None and grammar is None:
            return self
        sampling = replace(self.sampling, json_schema=json_schema, grammar=grammar)
        return replace(self, sampling=sampling)


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


def _bool(body: dict[str, Any], name: str, *, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in value
    ):
        raise _bad(f"'{name}' must be a list of token ids (integers 0 to 2^32 - 1)", name)
    return tuple(value)


def parse_sampling(
    body: Any, *, endpoint: str = "completion", default_max_tokens: int | None = None
) -> SamplingRequest:
    """The shared options of a chat or completion body; ``APIError(400)`` when invalid.

    Options this server does not implement are refused here (``openai_api.options``).
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    reject_unsupported(body, endpoint)
    model = body.get("model")
    if model is None:
        model = ""  # as in vLLM: the served model
    elif not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = default_max_tokens
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
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad(f"each stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        include_usage = _bool(options, "include_usage")
        continuous = _bool(options, "continuous_usage_stats")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    top_k = _int(body, "top_k", -1, 2**32 - 1) or 0
    processors = _processors(body)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad("'cache_salt' must be a string", "cache_salt")
    return SamplingRequest(
        model=model,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(0, top_k),  # -1 is vLLM's "off", as 0 is here
        seed=None if seed is None else seed % 2**64,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        user=user or None,
        ignore_eos=_bool(body, "ignore_eos"),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        cache_salt=salt or None,
        logprobs=_logprobs(body, endpoint),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        json_schema=_response_format(body.get("response_format")),
        **processors,
    )


def _processors(body: dict[str, Any]) -> dict[str, Any]:
    """Penalties, ``min_p`` and ``logit_bias`` as ``SamplingRequest`` fields."""
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if repetition == 0.0:
        raise _bad("'repetition_penalty' must be > 0", "repetition_penalty")
    raw_bias = body.get("logit_bias")
    bias: list[tuple[int, float]] = []
    if raw_bias is not None:
        if not isinstance(raw_bias, dict) or len(raw_bias) > 1024:
            raise _bad("'logit_bias' must be an object of at most 1024 entries", "logit_bias")
        for key, value in raw_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise _bad(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if (
                not 0 <= token < MAX_TOKEN_ID
                or not ok
                or not math.isfinite(value)
                or not -100 <= value <= 100
            ):
                raise _bad("'logit_bias' maps token ids to numbers in [-100, 100]", "logit_bias")
            bias.append((token, float(value)))
    return {
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": repetition,
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "logit_bias": tuple(sorted(bias)),
    }


def _response_format(raw: Any) -> str | None:
    """``response_format`` as the JSON schema the output must match (None: free text)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad(
                "'response_format.json_schema.schema' must be a JSON schema object",
                "response_format",
            )
        return json.dumps(schema, sort_keys=True)
    raise _bad("'response_format.type' must be text, json_object or json_schema", "response_format")


def _logprobs(body: dict[str, Any], endpoint: str) -> int | None:
    """Chat: ``logprobs`` true plus ``top_logprobs`` k; completions: ``logprobs`` k."""
    if endpoint == "chat":
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if not _bool(body, "logprobs"):
            if top:
                raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return top or 0
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    return _int(body, "logprobs", 0, MAX_LOGPROBS)


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
    sampling = parse_sampling(body, endpoint="chat")
    messages = parse_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatRequest(
        sampling,
        messages,
        add_generation_prompt=_bool(body, "add_generation_prompt", default=True),
        template_kwargs=tuple(sorted((kwargs or {}).items())),
        tools=parse_tools(body),
    )


def parse_messages(raw: Any) -> tuple[dict[str, Any], ...]:
    """Chat messages as the chat template receives them: ``{"role", "content": str}``, plus
    an assistant's ``tool_calls`` and a tool message's ``tool_call_id``."""
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages", "messages")
    messages = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", where)
        role = msg.get("role")
        if role not in ROLES:
            raise _bad(f"'role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
        content = msg.get("content")
        calls = msg.get("tool_calls") if role == "assistant" else None
        if content is None and role != "assistant":
            raise _bad(f"a {role} message needs 'content'", f"{where}.content")
        text = "" if content is None else _content_text(content, f"{where}.content")
        # Passed to the template exactly as the worker's own front passes it, so ids match.
        message: dict[str, Any] = {"role": role, "content": text}
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a tool message needs 'tool_call_id'", f"{where}.tool_call_id")
            message["tool_call_id"] = call_id
        messages.append(message)
    return tuple(messages)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates take them: ``arguments`` decoded
    from its JSON string to an object where it is one (as vLLM passes them)."""
    if not isinstance(raw, list):
        raise _bad("'tool_calls' must be a list", where)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise _bad(
                "a tool call is {id, type: function, function: {name, arguments: string}}",
                f"{where}[{j}]",
            )
        try:
            arguments: Any = json.loads(fn["arguments"])
        except ValueError:
            arguments = fn["arguments"]
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return calls


def parse_completion(body: Any) -> CompletionRequest:
    """A ``/v1/completions`` body (one prompt: a string or a list of token ids)."""
    sampling = parse_sampling(
        body, endpoint="completion", default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS
    )
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
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in prompt
        )
    ):
        return CompletionRequest(sampling, tuple(prompt))
    raise _bad("'prompt' must be a non-empty string or list of token ids (one prompt)", "prompt")
