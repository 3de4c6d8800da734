"""Request bodies of the worker's HTTP front: parsed, tokenized, turned into engine inputs.

Parsing is ``openai_api.requests`` (the gateway's parser too); here the body's
prompt meets the worker's own tokenizer and chat template, tokenized off the
event loop, and its options become the engine's ``SamplingParams``. Also the
typed ``AppKey``s every handler reads.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from openai_api.errors import APIError
from openai_api.json_body import parse_body
from openai_api.requests import ChatRequest, parse_chat, parse_completion
from openai_api.sampling import SamplingRequest
from openai_api.tools import JSON, Tools, tool_format
from worker.engine.sequence import SamplingParams
from worker.serve.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontInfo:
    """Static facts the HTTP front reports."""

    model_name: str
    worker_id: str
    max_model_len: int
    trust_body_salt: bool = False
    stall_s: float = 10.0  # /health fails past this long without an engine step


# The engine and tokenizer are duck-typed (worker.engine.thread.Engine, a transformers tokenizer).
ENGINE: web.AppKey[Any] = web.AppKey("engine")
TOKENIZER: web.AppKey[Any] = web.AppKey("tokenizer")
METRICS = web.AppKey("metrics", WorkerMetrics)
INFO = web.AppKey("info", FrontInfo)


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return error_from(APIError(status, message, param=param))


def error_from(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


@dataclass(frozen=True)
class Job:
    """One parsed generation request, its prompt tokenized."""

    kind: str  # "chat" | "completion"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage in every chunk
    cache_salt: str
    n: int = 1  # choices: one engine request each (the others after the first's first token)
    include_stop: bool = False  # include_stop_str_in_output
    tools: Tools | None = None  # tools the answer is read for calls of (tool_choice not none)
    tool_format: str = JSON  # how the chat template writes a call (openai_api.tools)


async def json_body(request: web.Request) -> dict[str, Any]:
    body = parse_body(await request.read())
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def check_model(request: web.Request, model: str) -> None:
    served = request.app[INFO].model_name
    if model and model != served:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this worker serves '{served}'",
            param="model",
            code="model_not_found",
        )


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def render_chat_text(tokenizer: Any, req: ChatRequest | tuple[dict[str, Any], ...]) -> str:
    """The prompt text the model sees: the folder's chat template over the messages."""
    if isinstance(req, ChatRequest):
        messages, add_gen, kwargs = (
            req.messages,
            req.add_generation_prompt,
            req.template_args(),
        )
    else:
        messages, add_gen, kwargs = req, True, {}
    try:
        return str(
            tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_gen, **kwargs
            )
        )
    except Exception as exc:  # jinja2 raises TemplateError or anything a template raises
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc


def encode_chat(tokenizer: Any, req: ChatRequest | tuple[dict[str, Any], ...]) -> list[int]:
    # The template already wrote the special tokens; do not add a second BOS.
    return list(tokenizer.encode(render_chat_text(tokenizer, req), add_special_tokens=False))


def engine_params(s: SamplingRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {max_model_len}",
            code="context_length_exceeded",
        )
    # Unset means "as much as fits": the engine rejects prompt + max_tokens > context.
    max_tokens = s.max_tokens if s.max_tokens is not None else max_model_len - prompt_len
    return SamplingParams(max_tokens=max_tokens, **s.engine_options())


async def parse_job(request: web.Request, kind: str) -> Job:
    body = await json_body(request)
    tokenizer = request.app[TOKENIZER]
    tools: Tools | None = None
    fmt = JSON
    if kind == "chat":
        chat = parse_chat(body)
        if chat.tools is not None:
            fmt = tool_format(tokenizer)
            tools = chat.tools if chat.tools.parsed else None
            chat = chat.with_tool_format(fmt)
        sampling = chat.sampling
        check_model(request, sampling.model)
        prompt_ids = await off_loop(encode_chat, tokenizer, chat)
    else:
        completion = parse_completion(body)
        sampling = completion.sampling
        check_model(request, sampling.model)
        if isinstance(completion.prompt, str):
            prompt_ids = await off_loop(
                lambda: list(tokenizer.encode(completion.prompt, add_special_tokens=True))
            )
        else:
            prompt_ids = list(completion.prompt)
    info = request.app[INFO]
    params = engine_params(sampling, len(prompt_ids), info.max_model_len)
    try:
        params.validate(request.app[ENGINE].vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    return Job(
        kind=kind,
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        params=params,
        stop=sampling.stop,
        stream=sampling.stream,
        include_usage=sampling.include_usage,
        continuous_usage=sampling.continuous_usage_stats,
        n=sampling.n,
        include_stop=sampling.include_stop_str_in_output,
        tools=tools,
        tool_format=fmt,
        cache_salt=(sampling.cache_salt or "") if info.trust_body_salt else "",
    )
