"""Every request option a client may send, with what kvroute does with it.

One table, three statuses: ``supported`` options change the output;
``ignored`` options are accepted and have no effect on a single stateless
server (``store``, ``metadata``, ...), as with vLLM; ``unsupported`` options
are answered ``400 unsupported_parameter`` naming the field whenever their
value asks for something — a client that asks for JSON or log-probabilities
must never get a silent 200 without them. A neutral value (``logprobs: false``,
``n: 1``, ``tools: []``, ``response_format: {"type": "text"}``) is always
accepted. The OpenAPI document (``gateway.edge.openapi``) is built from this
table, so it cannot drift from what the parser does.

Fields in no table are ignored, as vLLM ignores them: third-party clients send
their own extras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openai_api.errors import APIError

SUPPORTED = "supported"
IGNORED = "ignored"
UNSUPPORTED = "unsupported"

BOTH = ("chat", "completion")
CHAT = ("chat",)
COMPLETION = ("completion",)


def _absent(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == ""


def _one(v: Any) -> bool:
    return v is None or v == 1


def _text_format(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and v.get("type") == "text")


def _no_tool_choice(v: Any) -> bool:
    return v is None or v == "none"


def _text_modalities(v: Any) -> bool:
    return v is None or v == ["text"]


def _not_asked(v: Any) -> bool:
    return v is None or v is False


def _true_or_absent(v: Any) -> bool:
    return v is None or v is True


# name -> (status, endpoints, neutral(value) -> bool, what it does)
Option = tuple[str, tuple[str, ...], Callable[[Any], bool], str]
OPTIONS: dict[str, Option] = {
    "model": (SUPPORTED, BOTH, _absent, "a served model name or alias (see GET /v1/models)"),
    "messages": (SUPPORTED, CHAT, _absent, "roles system, developer, user, assistant, tool"),
    "prompt": (SUPPORTED, COMPLETION, _absent, "one string or one list of token ids"),
    "max_tokens": (SUPPORTED, BOTH, _absent, "default: what the context leaves (chat), 16"),
    "max_completion_tokens": (SUPPORTED, BOTH, _absent, "as max_tokens"),
    "temperature": (SUPPORTED, BOTH, _absent, "0 is greedy"),
    "top_p": (SUPPORTED, BOTH, _absent, "0 is greedy"),
    "top_k": (SUPPORTED, BOTH, _absent, "vLLM extension; 0 or -1 is off"),
    "seed": (SUPPORTED, BOTH, _absent, "reproducible sampling per request"),
    "stop": (SUPPORTED, BOTH, _absent, "up to 4 strings, never included in the output"),
    "stop_token_ids": (SUPPORTED, BOTH, _absent, "vLLM extension"),
    "ignore_eos": (SUPPORTED, BOTH, _absent, "vLLM extension"),
    "stream": (SUPPORTED, BOTH, _absent, "server-sent events ending in data: [DONE]"),
    "stream_options": (
        SUPPORTED,
        BOTH,
        _absent,
        "include_usage (a final usage chunk); continuous_usage_stats (usage in every chunk)",
    ),
    "user": (SUPPORTED, BOTH, _absent, "the session key when X-Session-ID is absent"),
    "n": (SUPPORTED, BOTH, _one, "up to 16 choices on one worker, sharing the prompt blocks"),
    "chat_template_kwargs": (SUPPORTED, CHAT, _absent, "passed to the chat template"),
    "add_generation_prompt": (SUPPORTED, CHAT, _absent, "default true"),
    "cache_salt": (
        SUPPORTED,
        BOTH,
        _absent,
        "honoured by a worker's own front only when trusted; the gateway uses the tenant's salt",
    ),
    "logprobs": (SUPPORTED, BOTH, _not_asked, "chat: true; completions: k alternatives"),
    "top_logprobs": (SUPPORTED, CHAT, _falsy, "alternatives per token, up to 20"),
    "logit_bias": (SUPPORTED, BOTH, _falsy, "per-token logit offsets"),
    "presence_penalty": (SUPPORTED, BOTH, _falsy, "penalty on tokens already generated"),
    "frequency_penalty": (SUPPORTED, BOTH, _falsy, "penalty by generated-token count"),
    "repetition_penalty": (SUPPORTED, BOTH, _one, "vLLM extension"),
    "min_p": (SUPPORTED, BOTH, _falsy, "vLLM extension"),
    "include_stop_str_in_output": (SUPPORTED, BOTH, _falsy, "vLLM extension"),
    "response_format": (
        SUPPORTED,
        BOTH,
        _text_format,
        "text, json_object, json_schema (constrained decoding, llguidance)",
    ),
    "tools": (
        SUPPORTED,
        CHAT,
        _falsy,
        "functions, rendered by the model's chat template; calls come back as tool_calls",
    ),
    "tool_choice": (
        SUPPORTED,
        CHAT,
        _no_tool_choice,
        "auto (calls parsed from the text), required and a named function "
        "(constrained decoding, llguidance), none",
    ),
    # Accepted with no effect, as on vLLM.
    "store": (IGNORED, CHAT, _absent, "nothing is stored"),
    "metadata": (IGNORED, CHAT, _absent, "nothing is stored"),
    "service_tier": (IGNORED, BOTH, _absent, "one tier"),
    "parallel_tool_calls": (IGNORED, CHAT, _absent, "meaningful only with tools"),
    "reasoning_effort": (IGNORED, CHAT, _absent, "the served models do not reason"),
    "priority": (IGNORED, BOTH, _absent, "one queue per worker"),
    # Asked for and not done: 400 unless neutral.
    "min_tokens": (UNSUPPORTED, BOTH, _falsy, "vLLM extension"),
    "functions": (UNSUPPORTED, CHAT, _falsy, "deprecated function calling"),
    "function_call": (UNSUPPORTED, CHAT, _no_tool_choice, "deprecated function calling"),
    "audio": (UNSUPPORTED, CHAT, _absent, "audio output"),
    "modalities": (UNSUPPORTED, CHAT, _text_modalities, "only text"),
    "prediction": (UNSUPPORTED, CHAT, _absent, "predicted outputs"),
    "web_search_options": (UNSUPPORTED, CHAT, _absent, "web search"),
    "echo": (UNSUPPORTED, COMPLETION, _falsy, "the prompt in front of the completion"),
    "best_of": (UNSUPPORTED, COMPLETION, _one, "server-side best of n"),
    "suffix": (UNSUPPORTED, COMPLETION, _falsy, "insertion after the completion"),
    "skip_special_tokens": (UNSUPPORTED, BOTH, _true_or_absent, "vLLM extension; default true"),
    "prompt_logprobs": (UNSUPPORTED, BOTH, _absent, "vLLM extension"),
    "use_beam_search": (UNSUPPORTED, BOTH, _falsy, "vLLM extension"),
    "allowed_token_ids": (UNSUPPORTED, BOTH, _absent, "vLLM extension"),
    "bad_words": (UNSUPPORTED, BOTH, _falsy, "vLLM extension"),
    "guided_json": (UNSUPPORTED, BOTH, _absent, "vLLM extension (structured output)"),
    "guided_regex": (UNSUPPORTED, BOTH, _absent, "vLLM extension (structured output)"),
    "guided_choice": (UNSUPPORTED, BOTH, _absent, "vLLM extension (structured output)"),
    "guided_grammar": (UNSUPPORTED, BOTH, _absent, "vLLM extension (structured output)"),
    "structured_outputs": (UNSUPPORTED, BOTH, _absent, "vLLM extension (structured output)"),
    "truncate_prompt_tokens": (UNSUPPORTED, BOTH, _absent, "vLLM extension"),
    "return_token_ids": (UNSUPPORTED, BOTH, _not_asked, "vLLM extension (ids in each choice)"),
    "return_tokens_as_token_ids": (UNSUPPORTED, BOTH, _not_asked, "vLLM extension"),
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def reject_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """``APIError(400, code="unsupported_parameter")`` for the first option asked for and not done."""
    for name, value in body.items():
        option = OPTIONS.get(name)
        if option is None:
            continue
        status, endpoints, neutral, what = option
        if status == UNSUPPORTED and endpoint in endpoints and not neutral(value):
            raise APIError(
                400,
                f"'{name}' is not supported by this server ({what}); remove it or send its default",
                param=name,
                code="unsupported_parameter",
            )


def options_for(endpoint: str) -> dict[str, tuple[str, str]]:
    """name -> (status, what it does) for ``endpoint`` ("chat" or "completion")."""
    return {
        name: (status, what)
        for name, (status, endpoints, _, what) in OPTIONS.items()
        if endpoint in endpoints
    }
