"""bench_overhead's instant fakes send as many messages per token as a real worker would."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from loadtest.instant_workers import _InstantGrpc, _openai_app, message_sizes


def test_message_sizes_follow_the_worker_stream_interval() -> None:
    assert message_sizes(128, 1) == [1] * 128
    assert message_sizes(128, 4) == [1] + [4] * 31 + [3]  # the first alone, the last at once
    assert message_sizes(1, 4) == [1]
    assert message_sizes(6, 8) == [1, 5]
    with pytest.raises(ValueError, match="--stream-interval"):
        message_sizes(8, 0)


@pytest.mark.parametrize("interval", [1, 4])
async def test_grpc_fake_streams_max_tokens_in_those_messages(interval: int) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_InstantGrpc("f", interval), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(
                prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=10)
            )
            msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
    finally:
        await server.stop(0)
    assert [len(m.token_ids) for m in msgs] == message_sizes(10, interval)
    assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
    last = msgs[-1]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 10)


async def test_http_fake_sends_one_event_per_message() -> None:
    client = TestClient(TestServer(_openai_app(4)))
    await client.start_server()
    try:
        body = {"model": "bench", "messages": [], "max_tokens": 10, "stream": True}
        resp = await client.post("/v1/chat/completions", json=body)
        raw = (await resp.read()).decode()
    finally:
        await client.close()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert [len(t) // 2 for t in texts] == message_sizes(10, 4)


def test_fake_cache_publishes_what_a_worker_stores_and_evicts() -> None:
    from contract.events import BlockRemoved, BlockStored
    from contract.hashing import HashSpec, block_hashes
    from loadtest.instant_workers import FakeCache
    from worker.publish.event_queue import EventQueue

    spec, events = HashSpec(block_size=4, model="m"), EventQueue()
    cache = FakeCache(spec, events, capacity=6)
    a, b = list(range(1, 17)), [*range(1, 9), *range(50, 59)]
    chain_a, chain_b = block_hashes(a, spec), block_hashes(b, spec)
    assert cache.serve(a, "") == 0  # cold: its 4 blocks stored, in chain order
    assert events.drain(10) == [BlockStored(tuple(chain_a), None)]
    assert cache.serve(a, "") == 16  # repeated: all cached, nothing to say
    assert events.drain(10) == []
    # b shares a's first 2 blocks: 2 new ones after them; 6 blocks fill the cache.
    assert cache.serve(b, "") == 8
    assert events.drain(10) == [BlockStored(tuple(chain_b[2:]), chain_b[1])]
    # The same prompt under a tenant's salt is another chain: its 4 new blocks evict the
    # 4 least recently used, a's last two, then the two b shares with a (b used them since).
    salted = block_hashes(a, spec.with_salt("t"))
    assert cache.serve(a, "t") == 0
    assert events.drain(10) == [
        BlockRemoved((chain_a[2], chain_a[3], chain_b[0], chain_b[1])),
        BlockStored(tuple(salted), None),
    ]
    assert cache.resident_block_hashes() == {*chain_b[2:], *salted}
    assert cache.stats().num_blocks == 6


async def test_a_gateway_mirror_holds_what_the_fakes_cached(redis_url: str) -> None:
    # The fakes publish through the real Publisher; the gateway's real mirror sees the
    # served prompt cached on its fake, and a fake reports it cached when it comes again.
    import asyncio
    import uuid
    from pathlib import Path
    from tempfile import TemporaryDirectory

    import redis.asyncio as aioredis

    from contract.hashing import HashSpec, block_hashes
    from contract.redis_layout import RedisLayout
    from gateway.routing.index import BlockIndex
    from gateway.routing.mirror import IndexMirror
    from loadtest.instant_workers import MODEL, serve_instant_workers

    ns = f"fakes-{uuid.uuid4().hex[:8]}"
    with TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        fakes = asyncio.create_task(serve_instant_workers(1, redis_url, ns, ready, 1, 64))
        index = BlockIndex()
        mirror = IndexMirror(redis_url, RedisLayout(ns), index, poll_s=0.05)
        follow = asyncio.create_task(mirror.run())
        try:
            for _ in range(200):
                if ready.exists() and "fake-0" in mirror.workers:
                    break
                await asyncio.sleep(0.05)
            address = mirror.workers["fake-0"].record.address
            prompt = list(range(100, 180))  # 5 blocks of 16
            chain = block_hashes(prompt, HashSpec(block_size=16, model=MODEL))
            request = pb.GenerateRequest(
                prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2)
            )
            async with grpc.aio.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                first = [m async for m in stub.Generate(request)][-1]
                again = [m async for m in stub.Generate(request)][-1]
            assert (first.usage.cached_tokens, again.usage.cached_tokens) == (0, 80)
            for _ in range(200):
                if index.longest_prefix(chain) == {"fake-0": 5}:
                    break
                await asyncio.sleep(0.05)
            assert index.longest_prefix(chain) == {"fake-0": 5}
        finally:
            follow.cancel()
            fakes.cancel()
            await asyncio.gather(follow, fakes, return_exceptions=True)
            client = aioredis.Redis.from_url(redis_url)
            keys = [k async for k in client.scan_iter(f"{ns}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


async def test_http_fake_answers_the_gateway_as_a_vllm_worker() -> None:
    # kvroute's own openai-http upstream against the fake's /v1/completions: vLLM's
    # stream (the prompt's ids echoed first, one event per token, usage last), and the
    # prompt cached by the second call, as vLLM's prefix cache would have it.
    from contract.hashing import HashSpec
    from gateway.upstream.base import Generation
    from gateway.upstream.openai_http import OpenAIHTTPUpstream
    from loadtest.instant_workers import MODEL, FakeCache
    from worker.publish.event_queue import EventQueue

    cache = FakeCache(HashSpec(block_size=16, model=MODEL), EventQueue(), capacity=64)
    server = TestServer(_openai_app(1, cache))
    await server.start_server()
    up = OpenAIHTTPUpstream()
    gen = Generation("r", list(range(100, 180)), 5, 0.0, 1.0, 0, None, True, (), "")
    try:
        for expected_cached in (0, 80):
            call = up.start("f", f"127.0.0.1:{server.port}", gen, 10.0)
            chunks = []
            while (c := await call.read()) is not None:
                chunks.append(c)
            assert [t for c in chunks for t in c.token_ids] == [1000, 1001, 1002, 1003, 1004]
            assert chunks[-1].finished and chunks[-1].finish_reason == "length"
            assert chunks[-1].cached_tokens == expected_cached
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            async with http.post(url, json={"prompt": "text"}) as resp:
                assert resp.status == 400  # only token ids, as the gateway sends them
    finally:
        await up.close()
        await server.close()
