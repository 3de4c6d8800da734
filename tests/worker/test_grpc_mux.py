"""``GenerateMany`` on a real worker: many framed calls on one stream, tiny Llama, real gRPC.

Each framed call must answer exactly as a ``Generate`` call would: the same
tokens and usage, bad input as an ``INVALID_ARGUMENT`` status (the other calls
on the stream unharmed), a cancel frame aborting the request and freeing its
blocks, new calls refused while the worker drains, and the stream ending once
the gateway closed its side and every call ended.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import grpc
import pytest

from contract import worker_pb2 as pb
from tests.worker.server_stack import Stack, random_ids

pytestmark = pytest.mark.timeout(60)


def _request(prompt: list[int], max_tokens: int = 4, **sampling: Any) -> pb.GenerateRequest:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling}
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**params))


class _Mux:
    """A raw ``GenerateMany`` stream: frames out, replies collected per call id."""

    def __init__(self, stack: Stack) -> None:
        self.call = stack.stub.GenerateMany()
        self.replies: dict[int, list[pb.ReplyFrame]] = defaultdict(list)
        self.messages = 0

    async def send(self, *frames: pb.CallFrame) -> None:
        await self.call.write(pb.CallFrames(frames=list(frames)))

    def ended(self, call_id: int) -> bool:
        got = self.replies.get(call_id, [])
        return bool(got) and (got[-1].HasField("status") or got[-1].response.finished)

    async def until_ended(self, *call_ids: int) -> None:
        while not all(self.ended(c) for c in call_ids):
            msg = await self.call.read()
            assert msg is not grpc.aio.EOF, "the stream ended before its calls"
            self.messages += 1
            for frame in msg.frames:
                self.replies[frame.call_id].append(frame)

    def tokens(self, call_id: int) -> list[int]:
        frames = self.replies[call_id]
        return [t for f in frames if f.HasField("response") for t in f.response.token_ids]


async def test_framed_calls_answer_as_generate_calls(stack: Stack) -> None:
    prompts = [random_ids(40 + 7 * i, 100 + i) for i in range(6)]
    expected = [await stack.generate(p, max_tokens=5) for p in prompts]
    mux = _Mux(stack)
    await mux.send(
        *[pb.CallFrame(call_id=10 + i, request=_request(p, 5)) for i, p in enumerate(prompts)]
    )
    await mux.until_ended(*range(10, 16))
    for i, want in enumerate(expected):
        assert mux.tokens(10 + i) == [t for c in want for t in c.token_ids]
        last = mux.replies[10 + i][-1].response
        assert last.finished and last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompts[i]), 5)
        assert last.worker_id == stack.worker_id
    # The replies of calls running together share messages.
    assert mux.messages < sum(len(mux.replies[c]) for c in range(10, 16))
    await mux.call.done_writing()
    assert await mux.call.read() is grpc.aio.EOF  # every call ended: the stream ends
    assert await mux.call.code() == grpc.StatusCode.OK


async def test_a_bad_call_is_a_status_frame_and_the_others_go_on(stack: Stack) -> None:
    mux = _Mux(stack)
    await mux.send(
        pb.CallFrame(call_id=1, request=_request([5, 10**6])),
        pb.CallFrame(call_id=2, request=_request(random_ids(30, 7), 3)),
    )
    await mux.until_ended(1, 2)
    status = mux.replies[1][-1].status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "vocabulary" in status.details
    assert len(mux.tokens(2)) == 3
    mux.call.cancel()


async def test_a_cancel_frame_aborts_the_request_and_frees_its_blocks(stack: Stack) -> None:
    mux = _Mux(stack)
    await mux.send(pb.CallFrame(call_id=7, request=_request(random_ids(100, 8), 1000)))
    while not mux.tokens(7):
        msg = await mux.call.read()
        for frame in msg.frames:
            mux.replies[frame.call_id].append(frame)
    assert stack.engine.stats().running == 1
    await mux.send(pb.CallFrame(call_id=7, cancel=True))
    await stack.wait_idle()
    assert stack.engine.stats().running == 0
    # The stream itself stays usable.
    await mux.send(pb.CallFrame(call_id=8, request=_request(random_ids(20, 9), 2)))
    await mux.until_ended(8)
    assert len(mux.tokens(8)) == 2
    mux.call.cancel()


async def test_the_gateway_going_away_aborts_every_call(stack: Stack) -> None:
    mux = _Mux(stack)
    await mux.send(
        *[pb.CallFrame(call_id=i, request=_request(random_ids(50, i), 1000)) for i in (1, 2)]
    )
    while not (mux.tokens(1) and mux.tokens(2)):
        msg = await mux.call.read()
        for frame in msg.frames:
            mux.replies[frame.call_id].append(frame)
    mux.call.cancel()
    await stack.wait_idle()
    assert stack.engine.stats().running == 0


async def test_a_draining_worker_refuses_new_framed_calls(stack: Stack) -> None:
    service = stack.service
    mux = _Mux(stack)
    await mux.send(pb.CallFrame(call_id=1, request=_request(random_ids(30, 3), 2)))
    await mux.until_ended(1)
    service.draining = True
    try:
        await mux.send(pb.CallFrame(call_id=2, request=_request(random_ids(30, 4), 2)))
        await mux.until_ended(2)
    finally:
        service.draining = False
    status = mux.replies[2][-1].status
    assert status.code == grpc.StatusCode.UNAVAILABLE.value[0] and "draining" in status.details
    mux.call.cancel()
