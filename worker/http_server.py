"""The worker's OpenAI-compatible HTTP front, for direct use and for third-party routers.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streaming),
``/v1/models``, ``/health``, ``/metrics``, and the vLLM-style helpers other
routers call: ``/tokenize``, ``/detokenize``, ``/v1/completions/render``,
``/v1/chat/completions/render`` and ``/get_load``. ``/server_info`` and
``/model_info`` answer 404 on purpose, so sglang-router does not try to fetch
a tokenizer from the worker.

Text goes through the model folder's own tokenizer and chat template
(``apply_chat_template(add_generation_prompt=True)``), tokenized off the event
loop. Unknown request fields are ignored; bad input answers 400 with an
OpenAI-shaped error body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from worker.metrics import CONTENT_TYPE, WorkerMetrics
from worker.sequence import SamplingParams
from worker.text_stream import TextStream

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class FrontInfo:
    """Static facts the HTTP front reports."""

    model_name: str
    worker_id: str
    max_model_len: int


ENGINE = web.AppKey("engine", Any)
TOKENIZER = web.AppKey("tokenizer", Any)
METRICS = web.AppKey("metrics", WorkerMetrics)
INFO = web.AppKey("info", FrontInfo)


class BadRequest(ValueError):
    """Client error: answered 400 (or ``status``) with an OpenAI-shaped body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "internal_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(str(exc), exc.status, exc.param)


def create_app(engine: Any, tokenizer: Any, *, model_name: str, worker_id: str,
               metrics: WorkerMetrics) -> web.Application:
    """The aiohttp application; all state lives under typed ``AppKey``s."""
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app[ENGINE] = engine
    app[TOKENIZER] = tokenizer
    app[METRICS] = metrics
    app[INFO] = FrontInfo(model_name, worker_id, int(engine.max_model_len))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/get_load", get_load)
    for path in ("/server_info", "/model_info", "/get_server_info", "/get_model_info"):
        app.router.add_get(path, not_provided)
    return app


async def start_http_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves ``app``; a client that disconnects cancels its handler (and so its request)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    return runner, bound


# --- request parsing ------------------------------------------------------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    served = request.app[INFO].model_name
    if model not in (None, "", served):
        raise BadRequest(f"the model {model!r} does not exist (this worker serves {served!r})",
                         param="model", status=404)
    return body


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise BadRequest(f"{what} must be a list of non-negative integer token ids", param=what)
    return value


def _completion_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and not any(isinstance(p, str | list) for p in prompt):
        return _int_list(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported: send one request per prompt",
                         param="prompt")
    raise BadRequest("prompt must be a non-empty string or list of token ids", param="prompt")


def _message_text(content: Any) -> str:
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
    raise BadRequest("message content must be a string or a list of text parts",
                     param="messages")


def render_chat_text(body: dict[str, Any], tokenizer: Any) -> str:
    """The prompt text the model sees: the folder's chat template over the messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    clean = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest("each message needs a string role", param="messages")
        clean.append({"role": msg["role"], "content": _message_text(msg.get("content"))})
    kwargs = body.get("chat_template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    add_generation_prompt = body.get("add_generation_prompt", True) is not False
    try:
        return str(tokenizer.apply_chat_template(
            clean, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs))
    except Exception as exc:  # jinja2 raises TemplateError or anything a template raises
        raise BadRequest(f"chat template failed: {exc}", param="messages") from exc


def _chat_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    # The template already wrote the special tokens; do not add a second BOS.
    return list(tokenizer.encode(render_chat_text(body, tokenizer), add_special_tokens=False))


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number", param=name)
    return float(value)


def _sampling(body: dict[str, Any], prompt_len: int, max_model_len: int,
              default_max_tokens: int | None) -> SamplingParams:
    if body.get("n", 1) not in (1, None):
        raise BadRequest("only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens or max(1, max_model_len - prompt_len)
    top_k = body.get("top_k")
    seed = body.get("seed")
    stop_ids = body.get("stop_token_ids") or []
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=seed,
        stop_token_ids=tuple(_int_list(stop_ids, "stop_token_ids")),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    return params


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BadRequest("stop must be a string or a list of strings", param="stop")


@dataclass
class _Job:
    """One parsed generation request."""

    kind: str  # "chat" | "completion"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    cache_salt: str


async def _parse_job(request: web.Request, kind: str) -> _Job:
    body = await _json_body(request)
    tokenizer = request.app[TOKENIZER]
    info = request.app[INFO]
    if kind == "chat":
        prompt_ids = await _off_loop(_chat_prompt, body, tokenizer)
    else:
        prompt_ids = await _off_loop(_completion_prompt, body, tokenizer)
    default_max = None if kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
    params = _sampling(body, len(prompt_ids), info.max_model_len, default_max)
    try:
        params.validate(request.app[ENGINE].vocab_size)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    if len(prompt_ids) >= info.max_model_len:
        raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                         f"{info.max_model_len}", param="messages" if kind == "chat" else "prompt")
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    salt = body.get("cache_salt")
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return _Job(kind, prefix + uuid.uuid4().hex, prompt_ids, params, _stop_strings(body),
                bool(body.get("stream", False)), include_usage,
                salt if isinstance(salt, str) else "")


# --- generation -----------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _Run:
    """Drives one engine request, turning its outputs into text deltas."""

    def __init__(self, request: web.Request, job: _Job) -> None:
        self.engine = request.app[ENGINE]
        self.job = job
        self.text = TextStream(request.app[TOKENIZER], job.stop)
        self.finish_reason: str | None = None
        self.prompt_tokens = len(job.prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0

    async def deltas(self) -> Any:
        """Yields text deltas; ends with ``finish_reason`` set. Aborts on early exit."""
        stream = self.engine.generate(self.job.request_id, self.job.prompt_ids, self.job.params,
                                      cache_salt=self.job.cache_salt)
        try:
            async for out in stream:
                self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
                self.completion_tokens += len(out.new_token_ids)
                delta = self.text.push(out.new_token_ids)
                if self.text.stopped:
                    self.finish_reason = "stop"
                elif out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                    delta += self.text.flush()
                if delta:
                    yield delta
                if self.finish_reason is not None:
                    return
        except ValueError as exc:
            if self.completion_tokens:
                raise
            raise BadRequest(str(exc)) from exc
        finally:
            # Stopped by a stop string, cancelled (client gone) or failed: free the blocks.
            if self.finish_reason is None or self.text.stopped:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
                self.engine.abort(self.job.request_id)

    def usage(self) -> dict[str, Any]:
        return _usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _choice(job: _Job, text: str | None, finish_reason: str | None, *, stream: bool,
            first: bool = False) -> dict[str, Any]:
    if job.kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish_reason}
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    job = await _parse_job(request, kind)
    run = _Run(request, job)
    info = request.app[INFO]
    created = int(time.time())
    obj = "chat.completion" if kind == "chat" else "text_completion"
    logger.debug("request %s: %d prompt tokens", job.request_id, len(job.prompt_ids))
    if not job.stream:
        parts = [delta async for delta in run.deltas()]
        return web.json_response({
            "id": job.request_id, "object": obj, "created": created, "model": info.model_name,
            "choices": [_choice(job, "".join(parts), run.finish_reason, stream=False)],
            "usage": run.usage(), "worker_id": info.worker_id,
        })

    chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {"id": job.request_id, "object": chunk_obj, "created": created,
                                "model": info.model_name, "choices": choices}
        if job.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    deltas = run.deltas()
    try:
        # Pull the first delta before committing to a 200, so bad input still gets a 400.
        first_delta = await anext(deltas, None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        if kind == "chat":
            await response.write(event([_choice(job, "", None, stream=True, first=True)]))
        if first_delta is not None:
            await response.write(event([_choice(job, first_delta, None, stream=True)]))
            async for delta in deltas:
                await response.write(event([_choice(job, delta, None, stream=True)]))
        final_text = None if kind == "chat" else ""
        await response.write(event([_choice(job, final_text, run.finish_reason, stream=True)]))
        if job.include_usage:
            await response.write(event([], run.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        # A write that failed (client gone) leaves the generator suspended: close it,
        # which aborts the engine request.
        await deltas.aclose()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


# --- helpers for other routers --------------------------------------------------------------


async def render_completion(request: web.Request) -> web.Response:
    body = await _json_body(request)
    ids = await _off_loop(_completion_prompt, body, request.app[TOKENIZER])
    return web.json_response({"token_ids": ids})


async def render_chat(request: web.Request) -> web.Response:
    body = await _json_body(request)
    tokenizer = request.app[TOKENIZER]
    text = await _off_loop(render_chat_text, body, tokenizer)
    ids = await _off_loop(lambda: list(tokenizer.encode(text, add_special_tokens=False)))
    return web.json_response({"token_ids": ids, "prompt": text})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
    body = await _json_body(request)
    tokenizer = request.app[TOKENIZER]
    if "messages" in body:
        ids = await _off_loop(_chat_prompt, body, tokenizer)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string", param="prompt")
        add_special = body.get("add_special_tokens", True) is not False
        ids = await _off_loop(lambda: list(tokenizer.encode(prompt,
                                                            add_special_tokens=add_special)))
    return web.json_response({"tokens": ids, "token_ids": ids, "count": len(ids),
                              "max_model_len": request.app[INFO].max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    body = await _json_body(request)
    key = "tokens" if "tokens" in body else "token_ids"
    ids = _int_list(body.get(key), key)
    if ids and max(ids) >= request.app[ENGINE].vocab_size:
        raise BadRequest("token id outside the vocabulary", param=key)
    text = await _off_loop(lambda: request.app[TOKENIZER].decode(ids))
    return web.json_response({"prompt": text})


async def models(request: web.Request) -> web.Response:
    info = request.app[INFO]
    return web.json_response({"object": "list", "data": [{
        "id": info.model_name, "object": "model", "created": 0, "owned_by": "kvroute",
        "root": info.model_name, "max_model_len": info.max_model_len}]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "worker_id": request.app[INFO].worker_id})


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def get_load(request: web.Request) -> web.Response:
    """sglang-router's load probe (it reads ``load``), with the engine's detail beside it."""
    stats = request.app[ENGINE].stats()
    return web.json_response({
        "load": int(stats.running) + int(stats.waiting), "running": int(stats.running),
        "waiting": int(stats.waiting), "queued_prefill_tokens": int(stats.queued_prefill_tokens),
        "free_blocks": int(stats.free_blocks), "num_blocks": int(stats.num_blocks)})


async def not_provided(request: web.Request) -> web.Response:
    # Deliberately absent: sglang-router would otherwise fetch a tokenizer from here.
    return error_response(f"{request.path} is not provided by a kvroute worker", 404)
