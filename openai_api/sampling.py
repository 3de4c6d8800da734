"""The sampling options of an OpenAI body, shared by chat and text completions.

``parse_sampling`` turns a decoded JSON body into a frozen ``SamplingRequest``
or raises ``APIError(400)`` naming the offending parameter; options this server
does not implement are refused (``openai_api.options``). ``top_p=0`` is the
limit of nucleus sampling, the single most likely token: it is parsed as
greedy (temperature 0), never passed on as "unset".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from openai_api.body_fields import (
    MAX_TOKEN_ID,
    bad_value,
    bool_field,
    int_field,
    number_field,
    token_ids_field,
)
from openai_api.errors import APIError
from openai_api.options import reject_unsupported

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer holds back this much text
MAX_CHOICES = 16  # n: choices per request
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
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
        raise bad_value("'model' must be a string", "model")
    n = int_field(body, "n", 1, MAX_CHOICES) or 1
    max_tokens = int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = default_max_tokens
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        if len(stop_raw) > MAX_STOP_STRINGS:
            raise bad_value(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        stop = tuple(s for s in stop_raw if s)
    else:
        raise bad_value("'stop' must be a string or a list of strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_value(f"each stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    stream = bool_field(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_value("'stream_options' must be an object", "stream_options")
        include_usage = bool_field(options, "include_usage")
        continuous = bool_field(options, "continuous_usage_stats")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_value("'user' must be a string", "user")
    seed = int_field(body, "seed", -(2**63), 2**64 - 1)
    temperature = number_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    top_k = int_field(body, "top_k", -1, 2**32 - 1) or 0
    processors = _processors(body)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad_value("'cache_salt' must be a string", "cache_salt")
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
        ignore_eos=bool_field(body, "ignore_eos"),
        stop_token_ids=token_ids_field(body.get("stop_token_ids"), "stop_token_ids"),
        cache_salt=salt or None,
        logprobs=_logprobs(body, endpoint),
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output"),
        json_schema=_response_format(body.get("response_format")),
        **processors,
    )


def _processors(body: dict[str, Any]) -> dict[str, Any]:
    """Penalties, ``min_p`` and ``logit_bias`` as ``SamplingRequest`` fields."""
    repetition = number_field(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if repetition == 0.0:
        raise bad_value("'repetition_penalty' must be > 0", "repetition_penalty")
    raw_bias = body.get("logit_bias")
    bias: list[tuple[int, float]] = []
    if raw_bias is not None:
        if not isinstance(raw_bias, dict) or len(raw_bias) > 1024:
            raise bad_value("'logit_bias' must be an object of at most 1024 entries", "logit_bias")
        for key, value in raw_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise bad_value(
                    f"'logit_bias' key {key!r} is not a token id", "logit_bias"
                ) from None
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if (
                not 0 <= token < MAX_TOKEN_ID
                or not ok
                or not math.isfinite(value)
                or not -100 <= value <= 100
            ):
                raise bad_value(
                    "'logit_bias' maps token ids to numbers in [-100, 100]", "logit_bias"
                )
            bias.append((token, float(value)))
    return {
        "presence_penalty": number_field(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": number_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": repetition,
        "min_p": number_field(body, "min_p", 0.0, 0.0, 1.0),
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
            raise bad_value(
                "'response_format.json_schema.schema' must be a JSON schema object",
                "response_format",
            )
        return json.dumps(schema, sort_keys=True)
    raise bad_value(
        "'response_format.type' must be text, json_object or json_schema", "response_format"
    )


def _logprobs(body: dict[str, Any], endpoint: str) -> int | None:
    """Chat: ``logprobs`` true plus ``top_logprobs`` k; completions: ``logprobs`` k."""
    if endpoint == "chat":
        top = int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
        if not bool_field(body, "logprobs"):
            if top:
                raise bad_value("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return top or 0
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    return int_field(body, "logprobs", 0, MAX_LOGPROBS)
