"""Instant fake workers for ``bench_overhead``: no inference, the tokens come back at once.

``serve_instant_workers`` runs (in its own process, until killed) N gRPC
fakes speaking kvroute's worker contract, each registered in Redis by the
real ``Publisher``, and N OpenAI HTTP fakes for the peer routers; it writes
the HTTP URLs to a file once every publisher has synced. What a router in
front of them costs is then all that is measured. Each gRPC fake keeps the
blocks of the prompts it served in a ``FakeCache`` and publishes them as a
real worker does, so kvroute's gateway pays for the cache events it would
get in a real fleet and finds a repeated history really cached.

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

The HTTP fakes also answer vLLM's ``/v1/completions`` as kvroute's gateway
calls a vLLM worker (token ids in, ``return_token_ids``, every field vLLM
0.32 writes in each event, the prompt's ids echoed in the first), each with
a cache of its own, registered as an ``openai-http`` worker in the namespace
``http_namespace`` names: a gateway there routes as it would to a vLLM fleet.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
from aiohttp import web

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.events import BlockRemoved, BlockStored, KVEvent
from contract.hashing import HashSpec, block_hashes
from contract.prompt_wire import PROMPT_LE32, prompt_ids, prompt_length
from contract.redis_layout import TRANSPORT_OPENAI_HTTP, WorkerRecord
from loadtest.fleet import free_port
from loadtest.scale_redis import FakeEngine
from worker.publish.event_queue import EventQueue
from worker.serve.frames_server import FramesServer
from worker.serve.grpc_mux import GenerateManyMixin

MODEL = "bench"
# Blocks each fake caches (16 tokens each: 1M tokens, a GPU worker's KV cache for an
# 8B model): a repeated chat stays cached, a stream of cold 6k-token ones evicts.
CACHE_BLOCKS = 65_536


def http_namespace(namespace: str) -> str:
    """Where the HTTP fakes are registered as openai-http workers (vLLM's transport)."""
    return f"{namespace}-http"


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


class FakeCache:
    """A worker's prefix cache with no memory behind it: the chain hashes of the prompts
    it served, the least recently used evicted past ``capacity`` blocks, every change
    published as a real worker's ``BlockStored`` / ``BlockRemoved`` events. The gateway
    in front then holds in its index what it would hold in a real fleet (a repeated
    history really cached, a cold prompt stored and older ones evicted), and pays for
    the events as it would.

    Also the ``Publisher``'s engine: ``stats`` and ``resident_block_hashes``.
    """

    def __init__(self, spec: HashSpec, events: EventQueue, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a fake cache of {capacity} blocks")
        self.spec, self.events, self.capacity = spec, events, capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, prompt: list[int], cache_salt: str) -> int:
        """Caches ``prompt``'s blocks (publishing what changed); returns how many of its
        tokens were cached before."""
        chain = block_hashes(prompt, self.spec.with_salt(cache_salt))
        blocks = self._blocks
        hit = 0
        while hit < len(chain) and chain[hit] in blocks:
            blocks.move_to_end(chain[hit])
            hit += 1
        new = chain[hit:]
        blocks.update(dict.fromkeys(new))
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        events: list[KVEvent] = []
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        if new:
            events.append(BlockStored(tuple(new), chain[hit - 1] if hit else None))
        self.events.put(events)
        return hit * self.spec.block_size

    def stats(self) -> Any:
        return SimpleNamespace(
            num_blocks=self.capacity,
            free_blocks=self.capacity - len(self._blocks),
            running=0,
            waiting=0,
            queued_prefill_tokens=0,
            prefill_tokens_per_s=0.0,
            decode_tokens_per_s=0.0,
        )

    def resident_block_hashes(self) -> set[int]:
        return set(self._blocks)


class _InstantGrpc(GenerateManyMixin, worker_pb2_grpc.WorkerServicer):
    """kvroute's worker contract with no engine: ``max_tokens`` tokens (``message_sizes``),
    the prompt's blocks cached in ``cache`` (``FakeCache``) when given."""

    def __init__(
        self, worker_id: str, stream_interval: int = 1, cache: FakeCache | None = None
    ) -> None:
        self.worker_id = worker_id
        self.stream_interval = stream_interval
        self.cache = cache

    async def Generate(self, request: Any, context: Any) -> Any:
        n = max(1, request.sampling.max_tokens)
        # As a real worker: the request's stream interval (the gateway's), else its own.
        sizes = message_sizes(n, request.stream_interval or self.stream_interval)
        sent = 0
        cached: int | None = None
        for size in sizes[:-1]:
            ids = [1000 + (sent + i) % 500 for i in range(size)]
            sent += size
            yield pb.GenerateResponse(token_ids=ids, worker_id=self.worker_id)
            if cached is None:  # a worker stores the prompt's blocks once its prefill ran
                cached = self._store(request)
        if cached is None:
            cached = self._store(request)
        yield pb.GenerateResponse(
            token_ids=[1000 + (sent + i) % 500 for i in range(sizes[-1])],
            finished=True,
            finish_reason="length",
            usage=pb.Usage(
                prompt_tokens=prompt_length(request), completion_tokens=n, cached_tokens=cached
            ),
            worker_id=self.worker_id,
        )

    def _store(self, request: Any) -> int:
        """Caches the request's prompt (``FakeCache.serve``); its cached tokens before."""
        if self.cache is None:
            return 0
        return self.cache.serve(prompt_ids(request), request.cache_salt)

    async def Health(self, request: Any, context: Any) -> Any:
        return pb.HealthResponse(serving=True)


def _completion_chunk(created: int, **choice: Any) -> bytes:
    """One SSE event of vLLM's ``/v1/completions`` stream, every field it writes."""
    full = {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        **choice,
    }
    chunk = {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": created,
        "model": MODEL,
        "choices": [full],
        "usage": None,
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


async def _completions(
    request: web.Request, stream_interval: int, cache: FakeCache | None
) -> web.StreamResponse:
    """vLLM's ``/v1/completions`` as kvroute's gateway calls it (``prompt`` as token ids,
    streamed, ``return_token_ids``, usage at the end): the first event echoes the
    prompt's ids, as vLLM 0.32 does, so a router pays for reading them."""
    body = await request.json()
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return web.json_response(
            {"error": {"message": "prompt: token ids", "code": 400}}, status=400
        )
    if not body.get("stream") or not body.get("return_token_ids"):
        return web.json_response({"error": {"message": "stream only", "code": 400}}, status=400)
    n = max(1, int(body.get("max_tokens") or 16))
    created = int(time.time())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    sizes = message_sizes(n, stream_interval)
    cached = 0
    sent = 0
    for k, size in enumerate(sizes):
        ids = [1000 + (sent + i) % 500 for i in range(size)]
        sent += size
        last = k == len(sizes) - 1
        await resp.write(
            _completion_chunk(
                created,
                text=" a" * size,
                token_ids=ids,
                prompt_token_ids=prompt if k == 0 else None,
                finish_reason="length" if last else None,
            )
        )
        if k == 0 and cache is not None:  # stored once its prefill ran, as the gRPC fake does
            cached = cache.serve(prompt, str(body.get("cache_salt") or ""))
    usage: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + n,
        "completion_tokens": n,
    }
    if cached:  # vLLM with --enable-prompt-tokens-details
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    final = {"id": "cmpl-x", "object": "text_completion", "created": created, "model": MODEL}
    final.update(choices=[], usage=usage)
    await resp.write(b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _openai_app(stream_interval: int = 1, cache: FakeCache | None = None) -> web.Application:
    """The OpenAI HTTP shape the peers forward to, answered at once; and vLLM's
    ``/v1/completions`` for kvroute's gateway (its blocks cached in ``cache``)."""

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

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _completions(request, stream_interval, cache)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/get_server_info", "/get_model_info"):
        app.router.add_get(path, ok)
    return app


async def serve_instant_workers(
    workers: int,
    redis_url: str,
    namespace: str,
    ready: Path,
    stream_interval: int = 1,
    cache_blocks: int = CACHE_BLOCKS,
) -> None:
    """Runs ``workers`` gRPC fakes (registered; each caching its prompts' blocks in a
    ``FakeCache`` of ``cache_blocks``, 0: none, publishing nothing) and as many HTTP
    fakes until killed."""
    fakes = _Fakes()
    try:
        for i in range(workers):
            await fakes.add(f"fake-{i}", redis_url, namespace, stream_interval, cache_blocks)
        while not all(p.synced for p in fakes.publishers):
            await asyncio.sleep(0.05)
        ready.write_text(json.dumps(fakes.urls))
        await asyncio.Event().wait()
    finally:  # cancelled (in a test; a benchmark kills the process)
        await fakes.close()


class _Fakes:
    """The servers ``serve_instant_workers`` started, to stop them when it is cancelled."""

    def __init__(self) -> None:
        self.urls: list[str] = []  # the HTTP fakes'
        self.publishers: list[Any] = []
        self._grpc: list[Any] = []
        self._frames: list[FramesServer] = []
        self._runners: list[web.AppRunner] = []

    async def add(
        self,
        worker_id: str,
        redis_url: str,
        namespace: str,
        stream_interval: int,
        cache_blocks: int,
    ) -> None:
        """One gRPC fake (with its frames port) and one HTTP fake, each registered."""

        spec = HashSpec(block_size=16, model=MODEL)
        events = EventQueue()
        cache = FakeCache(spec, events, cache_blocks) if cache_blocks else None
        servicer = _InstantGrpc(worker_id, stream_interval, cache)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._grpc.append(server)
        # The same stream on a frames port, as a worker started with --frames-port.
        self._frames.append(FramesServer(servicer))
        frames_port = await self._frames[-1].start("127.0.0.1", 0)
        grpc_record = replace(
            self._record(worker_id, spec, f"127.0.0.1:{port}"),
            frames_address=f"127.0.0.1:{frames_port}",
            prompt_encoding=PROMPT_LE32,
        )
        await self._register(grpc_record, namespace, redis_url, cache, events)
        # The HTTP fake: the peers' worker, and an openai-http worker (vLLM's shape) for
        # kvroute's gateway in the namespace beside (``http_namespace``), with its own cache.
        http_events = EventQueue()
        http_cache = FakeCache(spec, http_events, cache_blocks) if cache_blocks else None
        runner = web.AppRunner(_openai_app(stream_interval, http_cache), access_log=None)
        self._runners.append(runner)
        await runner.setup()
        http_port = free_port()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        url = f"http://127.0.0.1:{http_port}"
        self.urls.append(url)
        http_record = replace(
            self._record(f"{worker_id}-http", spec, url),
            transport=TRANSPORT_OPENAI_HTTP,
            http_url=url,
        )
        await self._register(
            http_record, http_namespace(namespace), redis_url, http_cache, http_events
        )

    @staticmethod
    def _record(worker_id: str, spec: HashSpec, address: str) -> WorkerRecord:
        return WorkerRecord(
            worker_id=worker_id,
            address=address,
            model=MODEL,
            hash_spec=spec.describe(),
            block_size=16,
            max_model_len=32768,
            prefill_tokens_per_s=10_000.0,
        )

    async def _register(
        self,
        record: WorkerRecord,
        namespace: str,
        redis_url: str,
        cache: FakeCache | None,
        events: EventQueue,
    ) -> None:
        """A real ``Publisher`` for one fake: its record, its heartbeat and, with a
        cache, its block events."""
        from worker.publish.publisher import Publisher, PublisherConfig

        pub = Publisher(
            cache if cache is not None else FakeEngine(set()),
            events,
            PublisherConfig(redis_url, record.worker_id, namespace, heartbeat_ttl=30.0),
            record,
        )
        await pub.start()
        self.publishers.append(pub)

    async def close(self) -> None:
        for pub in self.publishers:
            await pub.stop()
        for server in self._grpc:
            await server.stop(0)
        for f in self._frames:
            await f.stop(0)
        for r in self._runners:
            await r.cleanup()
