"""Gateway test fixtures: a shared real tokenizer, and a gateway on real HTTP + real Redis
in front of fake gRPC workers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from contract.hashing import HashSpec, block_hashes
from contract.redis_layout import RedisLayout
from gateway.config import GatewayConfig
from gateway.edge.app import create_app
from gateway.edge.app_keys import STATE, GatewayState
from gateway.text.tokenizer import ChatTokenizer
from tests.gateway.fakes import FakeRegistration, FakeWorker
from tests.gateway.helpers import eventually, namespace
from tests.models import qwen3_tokenizer_dir

MODEL = "SmolLM2-135M-Instruct"
SPEC = HashSpec(block_size=16, model=MODEL)
HELLO_CACHED = [{"role": "user", "content": "a prompt of a few blocks " * 8}]


@pytest.fixture(scope="session")
def chat_tok(smollm2: Path) -> ChatTokenizer:
    return ChatTokenizer(smollm2)


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def chat_tokenizer(request: pytest.FixtureRequest) -> ChatTokenizer:
    """SmolLM2's and Qwen3's tokenizers, one per test module."""
    if request.param == "smollm2":
        folder: Path = request.getfixturevalue("smollm2")
    else:
        folder = qwen3_tokenizer_dir()
    return ChatTokenizer(folder, cache_entries=64, cache_tokens=200_000)


@dataclass
class Harness:
    """A running gateway app plus the fake fleet behind it."""

    client: TestClient
    app: web.Application
    redis: aioredis.Redis
    layout: RedisLayout
    tok: ChatTokenizer
    workers: dict[str, tuple[FakeWorker, FakeRegistration]] = field(default_factory=dict)

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]

    async def add_worker(
        self,
        worker_id: str,
        reply: str = "Hello world",
        *,
        wait: bool = True,
        max_model_len: int = 2048,
        **fake: Any,
    ) -> tuple[FakeWorker, FakeRegistration]:
        # A second worker under one id would replace the first in ``workers`` and
        # leave its gRPC server running past the test (its __del__ then hangs exit).
        assert worker_id not in self.workers, f"{worker_id} was added already"
        ids = [*self.tok.encode_text(reply), 2]  # then <|im_end|>, as the model would
        worker = await FakeWorker(worker_id, ids, **fake).start()
        reg = FakeRegistration(
            self.redis, self.layout, worker_id, worker.address, SPEC, max_model_len=max_model_len
        )
        await reg.register()
        self.workers[worker_id] = (worker, reg)
        if wait:
            await eventually(lambda: worker_id in self.state.mirror.workers, what=worker_id)
        return worker, reg

    def chat_hashes(self, messages: list[dict[str, str]], salt: str = "") -> list[int]:
        return block_hashes(self.tok.encode_text(self.tok.render(messages)), SPEC.with_salt(salt))

    async def chat(self, messages: list[dict[str, str]], **extra: Any) -> Any:
        headers = extra.pop("headers", None)
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)


MakeGateway = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_gateway(
    redis_url: str, chat_tok: ChatTokenizer, smollm2: Path
) -> AsyncIterator[MakeGateway]:
    made: list[Harness] = []

    async def make(**overrides: Any) -> Harness:
        config = GatewayConfig(
            model_dir=smollm2,
            redis_url=redis_url,
            redis_namespace=namespace(),
            registry_poll_s=0.05,
        )
        config = replace(config, **overrides)
        app = create_app(config, tokenizer=chat_tok)
        client = TestClient(TestServer(app))
        await client.start_server()
        harness = Harness(client, app, aioredis.Redis.from_url(redis_url), config.layout, chat_tok)
        made.append(harness)
        return harness

    yield make
    for h in made:
        await h.client.close()
        for worker, _ in h.workers.values():
            await worker.stop()
        await h.redis.aclose()
    await asyncio.sleep(0)


@pytest.fixture
async def gateway(make_gateway: MakeGateway) -> Harness:
    return await make_gateway()


async def read_sse(resp: Any) -> list[Any]:
    """The JSON payloads of an SSE response, with the literal "[DONE]" kept as a string."""
    import json

    events: list[Any] = []
    buffer = ""
    async for raw in resp.content:
        buffer += raw.decode()
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            assert event.startswith("data: "), event
            data = event[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    with contextlib.suppress(Exception):
        resp.release()
    return events
