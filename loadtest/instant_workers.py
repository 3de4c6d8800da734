"""Instant fake workers for ``bench_overhead``: no inference, the tokens come back at once.

``serve_instant_workers`` runs (in its own process, until killed) N gRPC
fakes speaking kvroute's worker contract, each registered in Redis by the
real ``Publisher``, and N OpenAI HTTP fakes for the peer routers; it writes
the HTTP URLs to a file once every publisher has synced. What a router in
front of them costs is then all that is measured.

Messages per token follow a real worker's: the first token alone, then one
message per ``stream_interval`` tokens (the request's ``stream_interval``,
which the kvroute gateway sets, else the worker's ``--stream-interval``,
default 1), the last one as soon as it is ready (``message_sizes``); ``GenerateMany``
carries them as a real worker does. A real
worker merges further only the tokens that piled up while its own loop was
busy sending: a router that reads slowly does not slow the sends, since the
HTTP/2 window holds thousands of these ~15-byte messages. An engine that
keeps up sends one message per step, which is what these fakes send; they
do not invent a step time to merge on. The HTTP fakes send one SSE event
per message alike, so the peers get the same number of events per token.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.hashing import HashSpec
from contract.prompt_wire import PROMPT_LE32, prompt_length
from contract.redis_layout import WorkerRecord
from loadtest.fleet import free_port
from loadtest.scale_redis import FakeEngine
from worker.serve.frames_server import FramesServer
from worker.serve.grpc_mux import GenerateManyMixin

MODEL = "bench"


def message_sizes(n: int, stream_interval: int) -> list[int]:
    """Tokens per message for ``n`` tokens, as a worker with ``--stream-interval`` sends them."""
    if stream_interval < 1:
        raise ValueError(f"--stream-interval must be at least 1, got {stream_interval}")
    sizes = [1] if n > 0 else []
    left = n - 1
    while left > 0:
        sizes.append(min(stream_interval, left))
        left -= sizes[-1]
    return sizes


class _InstantGrpc(GenerateManyMixin, worker_pb2_grpc.WorkerServicer):
    """kvroute's worker contract with no engine: ``max_tokens`` tokens (``message_sizes``)."""

    def __init__(self, worker_id: str, stream_interval: int = 1) -> None:
        self.worker_id = worker_id
        self.stream_interval = stream_interval

    async def Generate(self, request: Any, context: Any) -> Any:
        n = max(1, request.sampling.max_tokens)
        # As a real worker: the request's stream interval (the gateway's), else its own.
        sizes = message_sizes(n, request.stream_interval or self.stream_interval)
        sent = 0
        for size in sizes[:-1]:
            ids = [1000 + (sent + i) % 500 for i in range(size)]
            sent += size
            yield pb.GenerateResponse(token_ids=ids, worker_id=self.worker_id)
        yield pb.GenerateResponse(
            token_ids=[1000 + (sent + i) % 500 for i in range(sizes[-1])],
            finished=True,
            finish_reason="length",
            usage=pb.Usage(
                prompt_tokens=prompt_length(request), completion_tokens=n, cached_tokens=0
            ),
            worker_id=self.worker_id,
        )

    async def Health(self, request: Any, context: Any) -> Any:
        return pb.HealthResponse(serving=True)


def _openai_app(stream_interval: int = 1) -> web.Application:
    """The OpenAI HTTP shape the peers forward to, answered at once."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        created = int(time.time())
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": created,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": " a" * n},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for size in message_sizes(n, stream_interval):
            delta = {"content": " a" * size}
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": created,
                "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model_path": MODEL, "is_generation": True})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/get_server_info", "/get_model_info"):
        app.router.add_get(path, ok)
    return app


async def serve_instant_workers(
    workers: int, redis_url: str, namespace: str, ready: Path, stream_interval: int = 1
) -> None:
    """Runs ``workers`` gRPC fakes (registered) and as many HTTP fakes until killed."""
    from worker.publish.event_queue import EventQueue
    from worker.publish.publisher import Publisher, PublisherConfig

    spec = HashSpec(block_size=16, model=MODEL)
    urls, pubs = [], []
    for i in range(workers):
        server = grpc.aio.server()
        servicer = _InstantGrpc(f"fake-{i}", stream_interval)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        # The same stream on a frames port, as a worker started with --frames-port.
        frames_port = await FramesServer(servicer).start("127.0.0.1", 0)
        record = WorkerRecord(
            worker_id=f"fake-{i}",
            address=f"127.0.0.1:{port}",
            frames_address=f"127.0.0.1:{frames_port}",
            prompt_encoding=PROMPT_LE32,
            model=MODEL,
            hash_spec=spec.describe(),
            block_size=16,
            max_model_len=32768,
            prefill_tokens_per_s=10_000.0,
        )
        pub = Publisher(
            FakeEngine(set()),
            EventQueue(),
            PublisherConfig(redis_url, f"fake-{i}", namespace, heartbeat_ttl=30.0),
            record,
        )
        await pub.start()
        pubs.append((server, pub))
        runner = web.AppRunner(_openai_app(stream_interval), access_log=None)
        await runner.setup()
        http_port = free_port()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        urls.append(f"http://127.0.0.1:{http_port}")
    while not all(p.synced for _, p in pubs):
        await asyncio.sleep(0.05)
    ready.write_text(json.dumps(urls))
    await asyncio.Event().wait()
