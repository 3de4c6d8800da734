"""The worker's OpenAI-compatible HTTP front, for direct use and for third-party routers.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streaming),
``/v1/models``, ``/health``, ``/metrics``, and the vLLM-style helpers other
routers call: ``/tokenize``, ``/detokenize``, ``/v1/completions/render``,
``/v1/chat/completions/render`` and ``/get_load``. ``/server_info`` and
``/model_info`` answer 404 on purpose, so sglang-router does not try to fetch
a tokenizer from the worker.

Text goes through the model folder's own tokenizer and chat template
(``apply_chat_template(add_generation_prompt=True)``), tokenized off the event
loop. Request bodies are parsed by ``openai_api.requests`` — the same parser as
the gateway's — and output text is assembled by ``openai_api.detokenizer``
(incremental, stop strings). A client that disconnects cancels its handler,
which aborts the engine request. ``cache_salt`` from a body is honoured only
when the worker runs with ``trust_body_salt`` (a deployment where only trusted
routers reach this port) or with a token, which every caller must then show
(``Authorization: Bearer``; probes and ``/metrics`` excepted); otherwise every
caller shares the unsalted cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from openai_api.detokenizer import Detokenizer
from openai_api.errors import APIError
from openai_api.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs, decoder
from openai_api.responses import (
    chat_choice,
    chat_response,
    completion_choice,
    completion_response,
    usage_dict,
)
from openai_api.tools import ToolCallStream, call_deltas
from worker.engine.types import EngineError
from worker.serve.http_helpers import (
    chat_render,
    detokenize,
    get_load,
    health,
    metrics_handler,
    models,
    not_provided,
    render_completion,
    require_token,
    reset_prefix_cache,
    tokenize,
)
from worker.serve.http_request import (
    ENGINE,
    INFO,
    METRICS,
    TOKENIZER,
    FrontInfo,
    Job,
    error_from,
    error_response,
    parse_job,
)
from worker.serve.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return error_from(exc)
    except EngineError as exc:
        logger.error("request to %s failed: %s", request.path, exc)
        return error_response(str(exc), 500)
    except RuntimeError as exc:  # the engine is shutting down
        logger.warning("request to %s refused: %s", request.path, exc)
        return error_response(str(exc), 503)


def create_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_name: str,
    worker_id: str,
    metrics: WorkerMetrics,
    trust_body_salt: bool = False,
    stall_s: float = 10.0,
    token: str = "",
) -> web.Application:
    """The aiohttp application; all state lives under typed ``AppKey``s.

    With ``token`` every request but probes and ``/metrics`` must carry it as a
    bearer header, and a body's ``cache_salt`` is honoured: only the fleet's
    routers hold the token.
    """
    middlewares = [_errors] + ([require_token(token)] if token else [])
    app = web.Application(middlewares=middlewares, client_max_size=64 << 20)
    app[ENGINE] = engine
    app[TOKENIZER] = tokenizer
    app[METRICS] = metrics
    app[INFO] = FrontInfo(
        model_name, worker_id, int(engine.max_model_len), trust_body_salt or bool(token), stall_s
    )
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/v1/chat/completions/render", chat_render)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    # The gateway's probe paths too: one convention across the project.
    app.router.add_get("/healthz", health)
    app.router.add_get("/readyz", health)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/get_load", get_load)
    for path in ("/server_info", "/model_info", "/get_server_info", "/get_model_info"):
        app.router.add_get(path, not_provided)
    return app


async def start_http_server(
    app: web.Application, host: str, port: int, *, shutdown_timeout_s: float = 60.0
) -> tuple[web.AppRunner, int]:
    """Serves ``app``; a client that disconnects cancels its handler (and so its request).

    ``runner.cleanup()`` lets requests in flight finish for ``shutdown_timeout_s``.
    """
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    return runner, bound


# --- generation -----------------------------------------------------------------------------


class _Run:
    """Drives one engine request, turning its outputs into text deltas."""

    def __init__(self, request: web.Request, job: Job) -> None:
        self.engine = request.app[ENGINE]
        self.job = job
        self.text = Detokenizer(
            request.app[TOKENIZER], job.prompt_ids, job.stop, include_stop=job.include_stop
        )
        self.finish_reason: str | None = None
        self.prompt_tokens = len(job.prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._decode = decoder(request.app[TOKENIZER])
        self._lp_pending: list[TokenLogprobs] = []
        self._sent_chars = 0
        # With tools the text of a call is held back; ``tool_calls`` holds it at the end.
        self.tools = ToolCallStream(job.tools, job.tool_format) if job.tools else None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.tools.calls if self.tools is not None else []

    def content(self, text: str) -> str | None:
        """The message content of the whole answer ``text`` (None: only tool calls)."""
        return self.tools.content() if self.tools is not None else text

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
                self._lp_pending.extend(
                    TokenLogprobs(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs
                )
                delta = self.text.push(out.new_token_ids)
                if self.text.stopped:
                    self.finish_reason = "stop"
                elif out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                    delta += self.text.finish()
                if self.tools is not None:
                    delta = self.tools.push(delta)
                    if self.finish_reason is not None:
                        delta += self.tools.finish()
                        if self.tools.calls:
                            self.finish_reason = "tool_calls"
                if delta:
                    yield delta
                if self.finish_reason is not None:
                    return
        except ValueError as exc:
            if self.completion_tokens:
                raise
            raise APIError(400, str(exc), code="invalid_value") from exc
        finally:
            # Stopped by a stop string, cancelled (client gone) or failed: free the blocks.
            if self.finish_reason is None or self.text.stopped:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
                self.engine.abort(self.job.request_id)

    def usage_body(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def take_logprobs(self, text: str | None) -> dict[str, Any] | None:
        """The logprobs object of the tokens since the last call (None when not asked)."""
        top = self.job.params.logprobs
        if top is None:
            return None
        items, self._lp_pending = self._lp_pending, []
        offset, self._sent_chars = self._sent_chars, self._sent_chars + len(text or "")
        if self.job.kind == "chat":
            return chat_logprobs(items, self._decode, top)
        return completion_logprobs(items, self._decode, top, offset)


def _choice(
    job: Job,
    text: str | None,
    finish_reason: str | None,
    *,
    stream: bool,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    if job.kind == "completion":
        return completion_choice(index, text or "", finish_reason, logprobs)
    if not stream:
        return chat_choice(index, text, finish_reason, logprobs, tool_calls)
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = call_deltas(tool_calls)
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _nth_choice(job: Job, i: int) -> Job:
    """Choice ``i`` of an ``n`` > 1 request: its own engine request id and seed."""
    seed = job.params.seed
    params = replace(job.params, seed=None if seed is None else (seed + i) % 2**64)
    return replace(job, request_id=f"{job.request_id}-{i}", params=params)


def _usage(runs: list[_Run]) -> dict[str, Any]:
    """The prompt once, every choice's generated tokens."""
    first = runs[0]
    completion = sum(r.completion_tokens for r in runs)
    return usage_dict(first.prompt_tokens, completion, first.cached_tokens)


async def _collect(runs: list[_Run]) -> list[str]:
    """Every choice's whole text; the others start once the first has its first token,
    so its prompt blocks are cached and shared."""
    gens = [r.deltas() for r in runs[:1]]
    try:
        first = await anext(gens[0], "")
        gens += [r.deltas() for r in runs[1:]]

        async def rest(g: Any) -> str:
            return "".join([d async for d in g])

        texts = list(await asyncio.gather(*(rest(g) for g in gens)))
    finally:
        for g in gens:
            await g.aclose()
    texts[0] = first + texts[0]
    return texts


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    job = await parse_job(request, kind)
    runs = [_Run(request, job)] + [_Run(request, _nth_choice(job, i)) for i in range(1, job.n)]
    info = request.app[INFO]
    created = int(time.time())
    logger.debug("request %s: %d prompt tokens", job.request_id, len(job.prompt_ids))
    if not job.stream:
        texts = await _collect(runs)
        choices = [
            _choice(
                r.job,
                r.content(text),
                r.finish_reason,
                stream=False,
                logprobs=r.take_logprobs(text),
                index=i,
                tool_calls=r.tool_calls,
            )
            for i, (r, text) in enumerate(zip(runs, texts, strict=True))
        ]
        build = chat_response if kind == "chat" else completion_response
        body = build(job.request_id, info.model_name, choices, _usage(runs))
        return web.json_response({**body, "worker_id": info.worker_id})

    chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": job.request_id,
            "object": chunk_obj,
            "created": created,
            "model": info.model_name,
            "choices": choices,
        }
        if job.continuous_usage:
            body["usage"] = usage or _usage(runs)
        elif job.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    async def relay(i: int, run: _Run, deltas: Any, first_delta: str | None) -> None:
        """One choice's chunks (choices of an n > 1 stream follow one another)."""
        if kind == "chat":
            await response.write(event([_choice(job, "", None, stream=True, first=True, index=i)]))
        if first_delta is not None:
            lps = run.take_logprobs(first_delta)
            await response.write(
                event([_choice(job, first_delta, None, stream=True, logprobs=lps, index=i)])
            )
            async for delta in deltas:
                lps = run.take_logprobs(delta)
                await response.write(
                    event([_choice(job, delta, None, stream=True, logprobs=lps, index=i)])
                )
        if run.tool_calls:
            calls = _choice(job, None, None, stream=True, index=i, tool_calls=run.tool_calls)
            await response.write(event([calls]))
        final = _choice(
            job,
            None if kind == "chat" else "",
            run.finish_reason,
            stream=True,
            logprobs=run.take_logprobs(None) if job.params.logprobs is not None else None,
            index=i,
        )
        await response.write(event([final]))

    deltas = runs[0].deltas()
    try:
        # Pull the first delta before committing to a 200, so bad input still gets a 400.
        first_delta = await anext(deltas, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            await relay(0, runs[0], deltas, first_delta)
            for i, run in enumerate(runs[1:], start=1):
                await deltas.aclose()
                deltas = run.deltas()
                await relay(i, run, deltas, await anext(deltas, None))
            if job.include_usage:
                await response.write(event([], _usage(runs)))
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
