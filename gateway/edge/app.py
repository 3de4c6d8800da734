"""The gateway's aiohttp application: ``create_app(config)`` wires every part together.

Routes: the OpenAI endpoints (``gateway.edge.handlers``), ``/health`` (liveness;
``/healthz`` is the same), ``/readyz``, ``/metrics``, ``/openapi.json`` and the
dashboard. Two middlewares: API-key authentication for ``/v1/*`` when a keys
file is configured, and error shaping, so every failure reaches the client as
an OpenAI error body; it also counts requests in flight and writes the access
log line. The index mirror runs as a background task owned by ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.edge import handlers
from gateway.edge.app_keys import STATE, TENANT, GatewayState
from gateway.edge.auth import ApiKeys
from gateway.edge.openapi import openapi_spec
from gateway.observe import dashboard
from gateway.observe.access_log import log_access
from gateway.observe.fleet_window import FleetWindow
from gateway.observe.loop_lag import watch_gc_pauses, watch_loop_lag
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.window_stats import RollingStats
from gateway.routing.dispatch import Dispatcher
from gateway.routing.index import BlockIndex
from gateway.routing.index_share import IndexServer, RemoteIndex, front_tasks, pod_id
from gateway.routing.mirror import IndexMirror
from gateway.routing.record_check import RecordCheck
from gateway.routing.replicas import ReplicaSync
from gateway.routing.router import Router
from gateway.routing.sessions import SessionMap
from gateway.text.fingerprint import tokenizer_fingerprint
from gateway.text.tokenizer import ChatTokenizer
from gateway.upstream.base import Upstream
from gateway.upstream.grpc_worker import GrpcUpstream
from gateway.upstream.openai_http import OpenAIHTTPUpstream
from openai_api.errors import APIError, error_body

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[STATE].metrics
    started = time.perf_counter()
    api = request.path.startswith("/v1/")
    if api:
        metrics.inflight_requests.inc()
    try:
        resp = await _shaped(request, handler)
    finally:
        if api:
            metrics.inflight_requests.dec()
    if api:  # probes, scrapes and the dashboard's polls are not traffic
        metrics.responses.labels(str(resp.status)).inc()
    log_access(request, resp.status, started)
    return resp


async def _shaped(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's response, or an OpenAI error body for whatever it raised."""
    try:
        resp = await handler(request)
    except APIError as exc:
        resp = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.status != 413 else "the request body is too large"
        if exc.status == 404:
            message = f"no route {request.method} {request.path}"
        resp = web.json_response(error_body(exc.status, message or exc.reason), status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        resp = web.json_response(error_body(500, "internal gateway error"), status=500)
    return resp


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[STATE].api_keys
    # The dashboard lists workers and their load: behind the keys too (/metrics is
    # left open for Prometheus; protect it at the network, see docs/SECURITY.md).
    if keys is not None and request.path.startswith(("/v1/", "/dashboard")):
        tenant = keys.tenant_for(request.headers.get("Authorization"))
        if tenant is None:
            raise APIError(
                401,
                "invalid or missing API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        request[TENANT] = tenant
    return await handler(request)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """200 once the index mirror has loaded from Redis, with or without workers.

    A gateway with no worker up stays ready on purpose: it answers each request
    503 with the reason, where an unready pod would leave clients a refused
    connection. ``healthy_workers`` in the body (and ``?workers=N``, which
    answers 503 below N) is for scripts that wait for a fleet.
    """
    state = request.app[STATE]
    healthy = len(state.dispatcher.healthy())
    loaded = state.mirror.redis_ok or state.mirror.has_snapshot
    try:
        want = int(request.query.get("workers", "0"))
    except ValueError:
        raise APIError(400, "workers must be an integer", param="workers") from None
    # A multi-process gateway's owner is ready once every front has listened.
    pod, fronts = state.pod, state.config.processes - 1
    started = pod.started(fronts) if isinstance(pod, IndexServer) else True
    body = {
        "ready": loaded and healthy >= want and started,
        "serving": state.ready(),
        "redis": state.mirror.redis_ok,
        "snapshot": state.mirror.has_snapshot,
        "healthy_workers": healthy,
        "pid": os.getpid(),  # which process of a multi-process gateway answered
        "processes": 1 + (pod.fronts_listening() if isinstance(pod, IndexServer) else 0),
    }
    return web.json_response(body, status=200 if body["ready"] else 503)


def refresh_gauges(state: GatewayState) -> None:
    """Sets the point-in-time gauges from the mirror and the dispatcher."""
    m = state.metrics
    healthy = state.dispatcher.healthy()
    m.healthy_workers.set(len(healthy))
    size = state.index.stats()
    for gauge, value in (
        (m.index_entries, size.entries),
        (m.index_hashes, size.hashes),
        (m.index_bytes, size.bytes),
        (m.index_evictions, size.evictions),
    ):
        gauge.set(value)
    for wid, entry in state.mirror.workers.items():
        m.index_blocks.labels(wid).set(state.index.block_count(wid))
        m.index_event_lag.labels(wid).set(entry.event_lag_s)
        s = state.dispatcher.state(entry, 0)
        m.set_worker(
            wid,
            running=s.running,
            waiting=s.waiting,
            queued_prefill_tokens=s.queued_prefill_tokens,
            inflight=s.inflight,
            free_blocks=entry.record.free_blocks,
            num_blocks=entry.record.num_blocks,
        )


async def _own_metrics(state: GatewayState) -> bytes:
    """This process's metrics (of a multi-process gateway: its share)."""
    refresh_gauges(state)
    return state.metrics.render()


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pod = state.pod
    body = await (pod.pod_metrics() if pod is not None else _own_metrics(state))
    return web.Response(
        body=body,
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_spec(request.app[STATE].config.model_names))


async def _background(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    tasks = {
        asyncio.create_task(state.mirror.run(), name="kvroute-index-mirror"),
        asyncio.create_task(
            watch_loop_lag(state.metrics.event_loop_lag_seconds), name="kvroute-loop-lag"
        ),
    }
    stop_gc_watch = watch_gc_pauses(state.metrics.gc_pause_seconds)
    replicas = state.dispatcher.replicas
    if replicas is not None:
        tasks.update(replicas.start())
    pod = state.pod
    render = functools.partial(_own_metrics, state)
    if isinstance(pod, IndexServer):
        await pod.start(render)
    elif isinstance(pod, RemoteIndex):
        await pod.connect(render)
        # Without its owner a front would route blind: it stops (``gateway.cli`` waits on
        # ``owner_lost``; the owner restarts fronts that exit).
        tasks.update(front_tasks(pod, state.owner_lost.set))
    yield
    if isinstance(pod, IndexServer):
        await pod.close()
    tasks |= state.background
    while tasks:
        # Cancel again until done: a library that swallowed one cancellation gets another.
        for t in tasks:
            t.cancel()
        _, tasks = await asyncio.wait(tasks, timeout=1.0)
    for upstream in state.dispatcher.upstreams.values():
        await upstream.close()
    stop_gc_watch()


def build_state(config: GatewayConfig, tokenizer: ChatTokenizer | None = None) -> GatewayState:
    """Every long-lived part of a gateway, wired together (no I/O yet)."""
    if tokenizer is None:
        tokenizer = ChatTokenizer(
            config.model_dir,
            cache_entries=config.tokenizer_cache_entries,
            cache_tokens=config.tokenizer_cache_tokens,
            executor_min_chars=config.executor_min_chars,
            fast_bpe=config.fast_bpe,
        )
    # A front process's own index stays empty: it looks blocks up in its owner's.
    index = BlockIndex(max_entries=0 if config.front else config.index_max_entries)
    pod: IndexServer | RemoteIndex | None = None
    if config.front:
        pod = RemoteIndex(config.index_socket)
    elif config.index_socket:
        pod = IndexServer(config.index_socket, index)
    openai_http = OpenAIHTTPUpstream()
    upstreams: dict[str, Upstream] = {
        "grpc": GrpcUpstream(
            config.grpc_tls_ca.read_bytes() if config.grpc_tls_ca else None,
            drain_s=config.request_timeout_s,
            token=config.grpc_token,
            mux=config.grpc_mux,
            frames=config.worker_frames,
        ),
        "openai-http": openai_http,
    }
    sessions = SessionMap(config.session_ttl_s)
    metrics = GatewayMetrics(config.model_name if config.vllm_metrics else None)
    metrics.watch_tokenizer_caches(
        {"chat": tokenizer.prefix_cache, "prompt": tokenizer.prompt_cache}
    )
    metrics.watch_http_pool(openai_http.pool)
    stats = RollingStats()
    mirror = IndexMirror(
        config.redis_url,
        config.layout,
        index,
        poll_s=config.registry_poll_s,
        cluster=config.redis_cluster,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        registry=metrics.registry,
        blocks=not config.front,
    )
    dispatcher = Dispatcher(
        mirror=mirror,
        index=pod if isinstance(pod, RemoteIndex) else index,
        router=Router(config.router, rotation_start=random.randrange(1 << 20)),
        upstreams=upstreams,
        sessions=sessions,
        metrics=metrics,
        stats=stats,
        speculative_ttl_s=config.speculative_ttl_s,
        max_queue_per_worker=config.max_queue_per_worker,
        request_timeout_s=config.request_timeout_s,
        max_retries=config.max_retries,
        first_token_timeout_s=config.first_token_timeout_s,
        inter_token_timeout_s=config.inter_token_timeout_s,
        record_check=RecordCheck(metrics.registry, stall_s=config.engine_stall_s),
        stream_interval=config.stream_interval,
    )

    def on_drop(worker_id: str) -> None:
        sessions.forget_worker(worker_id)
        metrics.forget_worker(worker_id)
        dispatcher.forget(worker_id)

    mirror.on_drop = on_drop
    mirror.on_discover = dispatcher.connect
    if config.replica_sync:
        dispatcher.replicas = ReplicaSync(
            mirror._client,
            config.layout.routes,
            None if config.front else index,
            sessions,
            dispatcher.loads,
            speculative_ttl_s=config.speculative_ttl_s,
            known_worker=mirror.workers.__contains__,
            prefix_demand=dispatcher.prefix_demand,
            pod=pod_id(config.index_socket) if config.index_socket else "",
        )
    keys = (
        ApiKeys.load(config.api_keys_file, config.tenant_salt_secret)
        if config.api_keys_file
        else None
    )
    return GatewayState(
        config=config,
        tokenizer=tokenizer,
        index=index,
        mirror=mirror,
        sessions=sessions,
        metrics=metrics,
        stats=stats,
        dispatcher=dispatcher,
        api_keys=keys,
        started_at=int(time.time()),
        pod=pod,
    )


def create_app(config: GatewayConfig, *, tokenizer: ChatTokenizer | None = None) -> web.Application:
    """The gateway as an aiohttp application (pass ``tokenizer`` to share a loaded one)."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors, _auth])
    app[STATE] = build_state(config, tokenizer)
    app[dashboard.WINDOW] = FleetWindow(app[STATE].metrics.registry, time.monotonic())
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model:.+}", handlers.model)
    app.router.add_get("/health", _healthz)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/dashboard", dashboard.page)
    app.router.add_get("/dashboard/data", dashboard.data)
    app.cleanup_ctx.append(_background)
    return app
