"""Test doubles for the gateway's unit and HTTP tests.

``FakeWorker`` is a real gRPC server (port 0) implementing the contract's
``WorkerServicer`` with scripted replies (and, with ``frames=True``, the same
``GenerateMany`` on a real frames port, ``worker.serve.frames_server``); ``FakeRegistration`` writes a
worker's Redis keys exactly as ``contract/redis_layout.py`` documents
(registry hash with TTL, directory set, block set, event stream).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import grpc
import redis.asyncio as aioredis

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
)
from contract.hashing import HashSpec
from contract.redis_layout import EVENT_FIELD, BlockSetWriter, RedisLayout, WorkerRecord
from worker.serve.frames_server import FramesServer
from worker.serve.grpc_mux import GenerateManyMixin


class FakeWorker(GenerateManyMixin, worker_pb2_grpc.WorkerServicer):
    """Answers every ``Generate`` with ``reply_ids``, one token per chunk (``GenerateMany``
    too, as a real worker: each framed call runs this ``Generate``)."""

    def __init__(
        self,
        worker_id: str,
        reply_ids: Sequence[int] = (),
        *,
        cached_tokens: int = 0,
        fail: grpc.StatusCode | None = None,
        delay_s: float = 0.0,
        finish_reason: str = "stop",
    ) -> None:
        self.worker_id = worker_id
        self.reply_ids = list(reply_ids)
        self.cached_tokens = cached_tokens
        self.fail = fail
        self.delay_s = delay_s
        self.finish_reason = finish_reason
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = 0
        self.completed = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.frames: FramesServer | None = None
        self.frames_port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def frames_address(self) -> str:
        return f"127.0.0.1:{self.frames_port}" if self.frames_port else ""

    async def start(self, *, frames: bool = False) -> FakeWorker:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        if frames:
            self.frames = FramesServer(self)
            self.frames_port = await self.frames.start("127.0.0.1", self.frames_port)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None
        if self.frames is not None:
            await self.frames.stop(0)
            self.frames = None

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "scripted failure")
        n = len(self.reply_ids)
        try:
            for i, token in enumerate(self.reply_ids):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == n - 1
                msg = pb.GenerateResponse(
                    token_ids=[token], finished=last, worker_id=self.worker_id
                )
                if last:
                    msg.finish_reason = self.finish_reason
                    msg.usage.prompt_tokens = len(request.prompt_token_ids)
                    msg.usage.completion_tokens = n
                    msg.usage.cached_tokens = self.cached_tokens
                yield msg
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return pb.HealthResponse(serving=True)


class FakeRegistration:
    """One worker's Redis keys, written the way the contract says a publisher writes them."""

    def __init__(
        self,
        client: aioredis.Redis,
        layout: RedisLayout,
        worker_id: str,
        address: str,
        spec: HashSpec,
        *,
        epoch: str = "epoch-1",
        max_model_len: int = 2048,
        ttl_ms: int = 60_000,
    ) -> None:
        self.client = client
        self.layout = layout
        self.spec = spec
        self.ttl_ms = ttl_ms
        self.seq = 0
        self.blockset = BlockSetWriter()  # the bucketed set, written as the publisher does
        self.record = WorkerRecord(
            worker_id=worker_id,
            address=address,
            model=spec.model,
            hash_spec=spec.describe(),
            block_size=spec.block_size,
            num_blocks=1000,
            max_model_len=max_model_len,
            epoch=epoch,
            free_blocks=1000,
            updated_at=time.time(),
        )

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    async def register(self, **load: int | float | str) -> None:
        """Writes (or refreshes) the registry hash with its TTL and the directory entry."""
        self.record = replace(self.record, updated_at=time.time(), **load)  # type: ignore[arg-type]
        key = self.layout.worker(self.worker_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=self.record.to_mapping())
            pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()
        await self.client.sadd(self.layout.workers, self.worker_id)

    async def expire(self) -> None:
        """As if the heartbeat stopped and the TTL ran out."""
        await self.client.delete(self.layout.worker(self.worker_id))

    async def publish(
        self,
        events: Sequence[KVEvent],
        *,
        seq: int | None = None,
        epoch: str | None = None,
        touch_set: bool = True,
        touch_stream: bool = True,
    ) -> None:
        """Applies ``events`` to the block set and appends one batch, in one MULTI/EXEC.

        ``touch_stream=False`` changes only the set: a batch whose event was lost.
        """
        blocks = self.layout.blocks(self.worker_id)
        batch = EventBatch(
            self.worker_id,
            epoch or self.record.epoch,
            self.seq if seq is None else seq,
            time.time(),
            tuple(events),
        )
        self.seq = batch.seq + 1
        async with self.client.pipeline(transaction=True) as pipe:
            if touch_set:
                for event in events:
                    write: dict[str, bytes] = {}
                    delete: list[str] = []
                    if isinstance(event, BlockStored) and event.block_hashes:
                        write, delete = self.blockset.change(event.block_hashes, ())
                    elif isinstance(event, BlockRemoved) and event.block_hashes:
                        write, delete = self.blockset.change((), event.block_hashes)
                    elif isinstance(event, AllBlocksCleared):
                        self.blockset.reset((), self.record.num_blocks)
                        pipe.delete(blocks)
                    if write:
                        pipe.hset(blocks, mapping=write)
                    if delete:
                        pipe.hdel(blocks, *delete)
            if touch_stream:
                pipe.xadd(self.layout.events(self.worker_id), {EVENT_FIELD: encode_batch(batch)})
            else:
                self.seq = batch.seq
            await pipe.execute()

    async def store(self, hashes: Sequence[int]) -> None:
        await self.publish([BlockStored(tuple(hashes))])

    async def remove(self, hashes: Sequence[int]) -> None:
        await self.publish([BlockRemoved(tuple(hashes))])
