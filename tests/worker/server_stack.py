"""A worker in-process for the server tests: what ``kvroute worker`` builds, on one runner.

``Stack`` wires engine thread, publisher, gRPC server and HTTP front as
``worker.serve.cli`` does; the ``stack`` fixture starts one per test on the
tiny random-weight Llama (``stack_runner``, ``stack_tokenizer``, one per test
module). ``tests/worker/conftest.py`` offers the fixtures to the worker tests;
elsewhere import them from here.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
import redis.asyncio as aioredis

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, WorkerRecord, decode_block_set
from worker.engine.thread import Engine, EngineConfig
from worker.publish.event_queue import EventQueue
from worker.publish.publisher import Publisher, PublisherConfig
from worker.serve.grpc_server import WorkerService, start_grpc_server
from worker.serve.http_server import create_app, start_http_server
from worker.serve.metrics import WorkerMetrics

NUM_BLOCKS = 80  # 1,280 tokens: one 1,000-token prompt fits, two evict each other
BLOCK = 16


class Stack:
    """Engine + publisher + gRPC + HTTP, wired as ``worker.serve.cli`` wires them."""

    def __init__(self, runner, tokenizer, redis_url: str, model: str = "tiny") -> None:
        self.worker_id = "w-" + uuid.uuid4().hex[:8]
        self.layout = RedisLayout("t" + uuid.uuid4().hex[:10])
        self.spec = HashSpec(block_size=runner.block_size, model=model)
        self.queue = EventQueue()
        self.engine = Engine(
            runner,
            EngineConfig(max_num_seqs=8, max_batch_tokens=2048),
            hash_spec=self.spec,
            on_events=self.queue.put,
        )
        self.metrics = WorkerMetrics(self.engine, self.worker_id)
        self.publisher = Publisher(
            self.engine,
            self.queue,
            PublisherConfig(
                redis_url=redis_url,
                worker_id=self.worker_id,
                namespace=self.layout.namespace,
                heartbeat_interval=0.2,
                heartbeat_ttl=1.0,
                retry_min_s=0.05,
                retry_max_s=0.3,
            ),
            WorkerRecord(
                self.worker_id,
                "",
                model=model,
                hash_spec=self.spec.describe(),
                block_size=BLOCK,
                num_blocks=self.engine.num_blocks,
                max_model_len=self.engine.max_model_len,
            ),
        )
        self.tokenizer = tokenizer
        self.model = model
        self.redis = aioredis.from_url(redis_url)

    async def start(self) -> Stack:
        self.engine.start()
        self.service = WorkerService(self.engine, worker_id=self.worker_id)
        self.grpc_server, self.grpc_port = await start_grpc_server(self.service, "127.0.0.1", 0)
        app = create_app(
            self.engine,
            self.tokenizer,
            model_name=self.model,
            worker_id=self.worker_id,
            metrics=self.metrics,
        )
        self.http_runner, self.http_port = await start_http_server(app, "127.0.0.1", 0)
        self.publisher.update_record(address=f"127.0.0.1:{self.grpc_port}")
        await self.publisher.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.http = aiohttp.ClientSession(f"http://127.0.0.1:{self.http_port}")
        self.openai = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0
        )
        return self

    async def close(self) -> None:
        await self.openai.close()
        await self.http.close()
        await self.channel.close()
        await self.publisher.stop()
        await self.grpc_server.stop(0)
        await self.http_runner.cleanup()
        self.engine.shutdown()
        await self.redis.aclose()

    async def generate(
        self, prompt: list[int], max_tokens: int = 4, stream_interval: int = 0, **kw
    ) -> list:
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}
        request = pb.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(**sampling),
            stream_interval=stream_interval,
        )
        return [chunk async for chunk in self.stub.Generate(request)]

    async def redis_set(self) -> set[int]:
        return set(decode_block_set(await self.redis.hvals(self.layout.blocks(self.worker_id))))

    async def wait_set_matches_pool(self, timeout: float = 5.0) -> set[int]:
        deadline = time.monotonic() + timeout
        while True:
            resident = self.engine.resident_block_hashes()
            if await self.redis_set() == resident:
                return resident
            if time.monotonic() > deadline:
                raise AssertionError("the Redis block set never matched the pool")
            await asyncio.sleep(0.02)

    async def wait_idle(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.stats().free_blocks != self.engine.num_blocks:
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks not freed: {self.engine.stats()}")
            await asyncio.sleep(0.01)


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(n)]


@pytest.fixture(scope="module")
def stack_runner(tiny_llama: Path) -> Any:
    from worker.model.runner import ModelRunner

    return ModelRunner(tiny_llama, block_size=BLOCK, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def stack_tokenizer(tiny_llama: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture
async def stack(stack_runner: Any, stack_tokenizer: Any, redis_url: str) -> AsyncIterator[Stack]:
    s = await Stack(stack_runner, stack_tokenizer, redis_url).start()
    yield s
    await s.close()
