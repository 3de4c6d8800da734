"""bench_overhead's instant fakes send as many messages per token as a real worker would."""

from __future__ import annotations

import json

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
