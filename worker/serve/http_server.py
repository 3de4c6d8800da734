"""The worker's OpenAI-compatible HTTP front, for direct use and for third-party routers.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streaming),
``/v1/models``, ``/health``, ``/metrics``, and the vLLM-style helpers other
routers call: ``/tokenize``, ``/detokenize``, ``/v1/completions/render``,
``/v1/chat/completions/render`` and ``/get_load``. ``/server_info`` and
``/model_info`` answer 404 on purpose, so sglang-router does not try to fetch
a tokenizer from the worker.

Text goes through the model folder's own tokenizer and chat template
(``apply_chat_template(add_generation_prompt=True)``), tokenized off the event
loop; request bodies are parsed in ``worker.serve.openai_protocol`` and output text
is assembled by ``worker.serve.text_stream`` (incremental, stop strings). A client
that disconnects cancels its handler, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from worker.engine.core import EngineError
from worker.serve.metrics import CONTENT_TYPE, WorkerMetrics
from worker.serve.openai_protocol import (
    BadRequest,
    Job,
    build_job,
    chat_prompt,
    completion_prompt,
    int_list,
    render_chat_text,
    usage_body,
)
from worker.serve.text_stream import TextStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontInfo:
    """Static facts the HTTP front reports."""

    model_name: str
    worker_id: str
    max_model_len: int


# The engine and tokenizer are duck-typed (worker.engine.core.Engine, a transformers tokenizer).
ENGINE: web.AppKey[Any] = web.AppKey("engine")
TOKENIZER: web.AppKey[Any] = web.AppKey("tokenizer")
METRICS = web.AppKey("metrics", WorkerMetrics)
INFO = web.AppKey("info", FrontInfo)


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}
    kind = kinds.get(status, "internal_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(str(exc), exc.status, exc.param)
    except EngineError as exc:
        logger.error("request to %s failed: %s", request.path, exc)
        return error_response(str(exc), 500)
    except RuntimeError as exc:  # the engine is shutting down
        logger.warning("request to %s refused: %s", request.path, exc)
        return error_response(str(exc), 503)


def create_app(
    engine: Any, tokenizer: Any, *, model_name: str, worker_id: str, metrics: WorkerMetrics
) -> web.Application:
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


async def start_http_server(
    app: web.Application, host: str, port: int
) -> tuple[web.AppRunner, int]:
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
        raise BadRequest(
            f"the model {model!r} does not exist (this worker serves {served!r})",
            param="model",
            status=404,
        )
    return body


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _parse_job(request: web.Request, kind: str) -> Job:
    body = await _json_body(request)
    tokenizer = request.app[TOKENIZER]
    to_ids = chat_prompt if kind == "chat" else completion_prompt
    prompt_ids = await _off_loop(to_ids, body, tokenizer)
    info = request.app[INFO]
    return build_job(body, kind, prompt_ids, info.max_model_len, request.app[ENGINE].vocab_size)


# --- generation -----------------------------------------------------------------------------


class _Run:
    """Drives one engine request, turning its outputs into text deltas."""

    def __init__(self, request: web.Request, job: Job) -> None:
        self.engine = request.app[ENGINE]
        self.job = job
        self.text = TextStream(request.app[TOKENIZER], job.stop)
        self.finish_reason: str | None = None
        self.prompt_tokens = len(job.prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0

    async def deltas(self) -> Any:
        """Yields text deltas; ends with ``finish_reason`` set. Aborts on early exit."""
        stream = self.engine.generate(
            self.job.request_id,
            self.job.prompt_ids,
            self.job.params,
            cache_salt=self.job.cache_salt,
        )
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

    def usage_body(self) -> dict[str, Any]:
        return usage_body(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _choice(
    job: Job, text: str | None, finish_reason: str | None, *, stream: bool, first: bool = False
) -> dict[str, Any]:
    if job.kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not stream:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
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
        return web.json_response(
            {
                "id": job.request_id,
                "object": obj,
                "created": created,
                "model": info.model_name,
                "choices": [_choice(job, "".join(parts), run.finish_reason, stream=False)],
                "usage": run.usage_body(),
                "worker_id": info.worker_id,
            }
        )

    chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": job.request_id,
            "object": chunk_obj,
            "created": created,
            "model": info.model_name,
            "choices": choices,
        }
        if job.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    deltas = run.deltas()
    try:
        # Pull the first delta before committing to a 200, so bad input still gets a 400.
        first_delta = await anext(deltas, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            if kind == "chat":
                await response.write(event([_choice(job, "", None, stream=True, first=True)]))
            if first_delta is not None:
                await response.write(event([_choice(job, first_delta, None, stream=True)]))
                async for delta in deltas:
                    await response.write(event([_choice(job, delta, None, stream=True)]))
            final = _choice(job, None if kind == "chat" else "", run.finish_reason, stream=True)
            await response.write(event([final]))
            if job.include_usage:
                await response.write(event([], run.usage_body()))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the status line is sent: report in-band, as vLLM does
            logger.exception("request %s failed mid-stream", job.request_id)
            error = {"error": {"message": str(exc), "type": "internal_error", "code": 500}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
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
    ids = await _off_loop(completion_prompt, body, request.app[TOKENIZER])
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
        ids = await _off_loop(chat_prompt, body, tokenizer)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string", param="prompt")
        add_special = body.get("add_special_tokens", True) is not False
        ids = await _off_loop(
            lambda: list(tokenizer.encode(prompt, add_special_tokens=add_special))
        )
    return web.json_response(
        {
            "tokens": ids,
            "token_ids": ids,
            "count": len(ids),
            "max_model_len": request.app[INFO].max_model_len,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    body = await _json_body(request)
    key = "tokens" if "tokens" in body else "token_ids"
    ids = int_list(body.get(key), key)
    if ids and max(ids) >= request.app[ENGINE].vocab_size:
        raise BadRequest("token id outside the vocabulary", param=key)
    text = await _off_loop(lambda: request.app[TOKENIZER].decode(ids))
    return web.json_response({"prompt": text})


async def models(request: web.Request) -> web.Response:
    info = request.app[INFO]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": info.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvroute",
                    "root": info.model_name,
                    "max_model_len": info.max_model_len,
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "worker_id": request.app[INFO].worker_id})


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def get_load(request: web.Request) -> web.Response:
    """sglang-router's load probe (it reads ``load``), with the engine's detail beside it."""
    stats = request.app[ENGINE].stats()
    return web.json_response(
        {
            "load": int(stats.running) + int(stats.waiting),
            "running": int(stats.running),
            "waiting": int(stats.waiting),
            "queued_prefill_tokens": int(stats.queued_prefill_tokens),
            "free_blocks": int(stats.free_blocks),
            "num_blocks": int(stats.num_blocks),
        }
    )


async def not_provided(request: web.Request) -> web.Response:
    # Deliberately absent: sglang-router would otherwise fetch a tokenizer from here.
    return error_response(f"{request.path} is not provided by a kvroute worker", 404)
