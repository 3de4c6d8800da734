"""The worker's helper endpoints: what vLLM-style routers and probes call besides generation.

``/tokenize``, ``/detokenize``, ``/v1/completions/render``,
``/v1/chat/completions/render``, ``/v1/models``, ``/reset_prefix_cache``,
``/health`` (also ``/healthz`` and ``/readyz``), ``/metrics``, ``/get_load``,
and the paths answered 404 on purpose; and the bearer-token check in front of
all of them when the worker runs with ``--grpc-token-file``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from contract.grpc_auth import is_bearer
from openai_api.errors import APIError
from openai_api.messages import parse_messages
from openai_api.requests import parse_chat, parse_completion
from worker.serve.http_request import (
    ENGINE,
    INFO,
    METRICS,
    TOKENIZER,
    check_model,
    encode_chat,
    error_response,
    json_body,
    off_loop,
    render_chat_text,
)
from worker.serve.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Kubelet probes and Prometheus scrapes carry no token: these stay open. Nothing on
# them reveals a prompt or lets a caller touch the cache.
OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})


def require_token(token: str) -> Any:
    """Middleware: every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <token>``."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not is_bearer(
            request.headers.get("Authorization"), token
        ):
            raise APIError(
                401,
                "this worker needs the fleet token (Authorization: Bearer <token>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return check


async def render_completion(request: web.Request) -> web.Response:
    body = await json_body(request)
    completion = parse_completion(body)
    check_model(request, completion.sampling.model)
    prompt = completion.prompt
    if isinstance(prompt, str):
        tokenizer = request.app[TOKENIZER]
        ids = await off_loop(lambda: list(tokenizer.encode(prompt, add_special_tokens=True)))
    else:
        ids = list(prompt)
    return web.json_response({"token_ids": ids})


async def chat_render(request: web.Request) -> web.Response:
    body = await json_body(request)
    chat = parse_chat(body)
    check_model(request, chat.sampling.model)
    tokenizer = request.app[TOKENIZER]
    text = await off_loop(render_chat_text, tokenizer, chat)
    ids = await off_loop(lambda: list(tokenizer.encode(text, add_special_tokens=False)))
    return web.json_response({"token_ids": ids, "prompt": text})


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise APIError(400, f"'{what}' must be a list of non-negative token ids", param=what)
    return value


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
    body = await json_body(request)
    tokenizer = request.app[TOKENIZER]
    if "messages" in body:
        ids = await off_loop(encode_chat, tokenizer, parse_messages(body["messages"]))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string", param="prompt")
        add_special = body.get("add_special_tokens", True) is not False
        ids = await off_loop(lambda: list(tokenizer.encode(prompt, add_special_tokens=add_special)))
    return web.json_response(
        {
            "tokens": ids,
            "token_ids": ids,
            "count": len(ids),
            "max_model_len": request.app[INFO].max_model_len,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    body = await json_body(request)
    key = "tokens" if "tokens" in body else "token_ids"
    ids = _int_list(body.get(key), key)
    if ids and max(ids) >= request.app[ENGINE].vocab_size:
        raise APIError(400, "a token id is outside the vocabulary", param=key)
    text = await off_loop(lambda: request.app[TOKENIZER].decode(ids))
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


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's ``POST /reset_prefix_cache``: forget every cached block (announced to Redis)."""
    if not await off_loop(request.app[ENGINE].reset_prefix_cache):
        raise APIError(409, "blocks are in use; retry when the worker is idle", code="busy")
    return web.json_response({"status": "ok"})


async def health(request: web.Request) -> web.Response:
    """200 while the engine steps; 503 when its thread died or is stuck (a liveness probe)."""
    info = request.app[INFO]
    problem = request.app[ENGINE].health(info.stall_s)
    if problem is not None:
        body = {"status": "unhealthy", "reason": problem, "worker_id": info.worker_id}
        return web.json_response(body, status=503)
    return web.json_response({"status": "ok", "worker_id": info.worker_id})


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
