"""The bridge's epochs against a fake engine replaying recorded vLLM frames, and a real Redis.

The fake engine is vLLM's wire surface only: a ZMQ PUB and replay ROUTER
sending frames recorded from vLLM 0.32 (``data/vllm_events/session.jsonl``),
and ``/health``, ``/v1/models``, ``/metrics`` and ``/tokenize`` on port 0. The
real vLLM runs in ``tests/vllm``; here the seq gaps and resets are made on
purpose.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from aiohttp import web

from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, decode_block_set
from tests.gateway.helpers import eventually, namespace
from tests.support import free_port
from worker.bridge.bridge import EXIT_TOKENIZER_MISMATCH, Bridge, BridgeConfig
from worker.bridge.chain_map import ChainMap
from worker.bridge.engine_events import parse_published

DATA = Path(__file__).parent / "data" / "vllm_events"
SPEC = HashSpec(block_size=32, model="m")


def _recorded() -> list[list[bytes]]:
    frames = []
    for line in (DATA / "session.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "pub" in rec:
            frames.append([base64.b64decode(f) for f in rec["pub"]])
    return frames[:-1]  # the first boot: seq 4..12


def _renumber(frames: list[bytes], seq: int) -> list[bytes]:
    return [frames[0], seq.to_bytes(8, "big"), frames[2]]


class FakeTokenizer:
    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool, tokenize: bool
    ) -> str:
        return "".join(m["content"] for m in messages) + "<a>"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [ord(c) for c in text]


class FakeEngine:
    """vLLM's HTTP and ZMQ surface, with frames the test decides to publish."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.events_port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.events_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: list[list[bytes]] = []  # what the replay endpoint holds
        self.healthy = True
        self.tokenize_offset = 0
        self.runner: web.AppRunner | None = None
        self.url = ""
        self._replay_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self._replay_task = asyncio.create_task(self._serve_replays())

    async def stop(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self.runner is not None:
            await self.runner.cleanup()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()

    async def publish(self, frames: list[bytes], *, buffered: bool = True) -> None:
        if buffered:
            self.buffer.append(frames)
        await self.pub.send_multipart(frames)

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for frames in self.buffer:
                if int.from_bytes(frames[1], "big") >= first:
                    await self.router.send_multipart([client, b"", *frames])
            end = (-1).to_bytes(8, "big", signed=True)
            await self.router.send_multipart([client, b"", b"", end, b""])

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 2048}]})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            text='vllm:num_requests_running{engine="0"} 1.0\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="96"} 1.0\n'
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        tok = FakeTokenizer()
        if "messages" in body:
            ids = tok.encode(tok.apply_chat_template(body["messages"], True, False), False)
        else:
            ids = tok.encode(body["prompt"], False)
        return web.json_response({"tokens": [i + self.tokenize_offset for i in ids]})


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    await fake.start()
    yield fake
    await fake.stop()


@contextlib.asynccontextmanager
async def bridged(engine: FakeEngine, redis_url: str, ns: str) -> AsyncIterator[Bridge]:
    config = BridgeConfig(
        events=f"tcp://127.0.0.1:{engine.events_port}",
        replay=f"tcp://127.0.0.1:{engine.replay_port}",
        url=engine.url,
        redis_url=redis_url,
        namespace=ns,
        worker_id="v",
        model_name="m",
        heartbeat_interval=0.1,
        heartbeat_ttl=1.0,
        replay_timeout_s=1.0,
    )
    bridge = Bridge(config, tokenizer_loader=lambda _name: FakeTokenizer())
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    try:
        yield bridge
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _expected(frames: list[list[bytes]]) -> set[int]:
    chain = ChainMap(SPEC)
    for f in frames:
        chain.apply(parse_published(f).events)
    return chain.resident_block_hashes()


async def _state(client: aioredis.Redis, ns: str) -> tuple[set[int], str]:
    layout = RedisLayout(ns)
    blocks = set(decode_block_set(await client.hvals(layout.blocks("v"))))
    epoch = await client.hget(layout.worker("v"), "epoch")
    return blocks, epoch.decode() if epoch else ""


async def test_catch_up_gap_fill_and_seq_reset(engine: FakeEngine, redis_url: str) -> None:
    frames = [_renumber(f, i) for i, f in enumerate(_recorded())]  # seq 0..8
    client = aioredis.Redis.from_url(redis_url)
    ns = namespace()
    # Published before the bridge exists: only the replay buffer can tell it.
    for f in frames[:3]:
        await engine.publish(f)
    try:
        async with bridged(engine, redis_url, ns) as bridge:
            await eventually(lambda: bridge.publisher is not None and bridge.publisher.synced, 10)
            state: dict[str, Any] = {}

            async def settle(expected: set[int]) -> None:
                for _ in range(100):
                    state["blocks"], state["epoch"] = await _state(client, ns)
                    if state["blocks"] == expected:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{len(state['blocks'])} blocks, wanted {len(expected)}")

            await settle(_expected(frames[:3]))  # caught up from the replay endpoint
            epoch1 = state["epoch"]
            await asyncio.sleep(0.3)  # the SUB socket has joined
            await engine.publish(frames[3])
            # seq 4 and 5 never reach the subscriber: the replay endpoint fills the gap.
            engine.buffer.append(frames[4])
            engine.buffer.append(frames[5])
            await engine.publish(frames[6])
            await settle(_expected(frames[:7]))  # evictions included (frame 6 removes blocks)
            assert state["epoch"] == epoch1 and bridge.epochs == 1
            # A gap the buffer no longer holds: a new epoch from what is known.
            await engine.publish(frames[8], buffered=False)
            # The new epoch has caught up (its publisher exists only after that) before
            # the engine restarts below: a restart while it still caught up found the
            # replay buffer already empty, so seq 0 looked like a plain first batch and
            # no third epoch came (CI, once).
            await eventually(
                lambda: bridge.epochs == 2 and bridge.publisher is not None,
                10,
                what="a new epoch after the gap",
            )
            # vLLM restarted: seq starts again at 0 (with other content than the old seq 0).
            engine.buffer = []
            reboot = _renumber(frames[4], 0)
            await engine.publish(reboot)
            await eventually(lambda: bridge.epochs == 3, 10, what="a new epoch after the reset")
            await settle(_expected([reboot]))
            assert state["epoch"] not in ("", epoch1)
    finally:
        await client.aclose()


async def test_engine_down_deregisters_and_comes_back(engine: FakeEngine, redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    ns = namespace()
    try:
        async with bridged(engine, redis_url, ns) as bridge:
            await eventually(lambda: bridge.publisher is not None and bridge.publisher.synced, 10)
            engine.healthy = False
            engine.buffer = []
            await eventually(lambda: bridge.publisher is None, 5, what="deregistration")
            assert not await client.exists(RedisLayout(ns).worker("v"))
            engine.healthy = True
            await eventually(lambda: bridge.epochs == 2 and bridge.publisher is not None, 10)
    finally:
        await client.aclose()


async def test_tokenizer_mismatch_refuses_to_register(
    engine: FakeEngine, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine.tokenize_offset = 1  # the engine's vocabulary is shifted by one id
    ns = namespace()
    config = BridgeConfig(
        events=f"tcp://127.0.0.1:{engine.events_port}",
        url=engine.url,
        redis_url=redis_url,
        namespace=ns,
        worker_id="v",
    )
    bridge = Bridge(config, tokenizer_loader=lambda _name: FakeTokenizer())
    code = await asyncio.wait_for(bridge.run(asyncio.Event()), 10)
    assert code == EXIT_TOKENIZER_MISMATCH
    assert "refusing to register" in caplog.text
    client = aioredis.Redis.from_url(redis_url)
    assert not await client.exists(RedisLayout(ns).worker("v"))
    await client.aclose()
