"""OpenAI request bodies: parsing with validation, the one parser of every kvroute front.

Parsing turns a decoded JSON body into a frozen dataclass or raises
``APIError(400)`` naming the offending parameter; nothing here touches the
network or the tokenizer. The gateway's edge and a worker's own HTTP front
both call these functions, so a body means the same thing on either.
``parse_chat`` and ``parse_completion`` are the two endpoints' bodies; the
options they share are ``openai_api.sampling``, chat messages
``openai_api.messages``.

Defaults follow OpenAI and vLLM: ``/v1/completions`` generates 16 tokens when
``max_tokens`` is unset, chat generates as much as the context leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from openai_api.body_fields import MAX_TOKEN_ID, bad_value, bool_field
from openai_api.messages import parse_messages
from openai_api.sampling import SamplingRequest, parse_sampling
from openai_api.tools import Tools, constraint, parse_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


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


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` body."""
    sampling = parse_sampling(body, endpoint="chat")
    messages = parse_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_value("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatRequest(
        sampling,
        messages,
        add_generation_prompt=bool_field(body, "add_generation_prompt", default=True),
        template_kwargs=tuple(sorted((kwargs or {}).items())),
        tools=parse_tools(body),
    )


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
            raise bad_value("'prompt' must not be empty", "prompt")
        return CompletionRequest(sampling, prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in prompt
        )
    ):
        return CompletionRequest(sampling, tuple(prompt))
    raise bad_value(
        "'prompt' must be a non-empty string or list of token ids (one prompt)", "prompt"
    )
