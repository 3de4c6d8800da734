"""The SSE relay over real gRPC: a worker message of several tokens is one event.

A worker that falls behind, or runs with ``--stream-interval``, sends several
tokens per message; the gateway turns each message into one event (one
detokenizer push, one encoding, one write), logprobs included, and reports a
worker that fails mid-stream in-band.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from contract import worker_pb2 as pb
from tests.gateway.conftest import MODEL, SPEC, Harness
from tests.gateway.fakes import FakeRegistration, FakeWorker
from tests.gateway.helpers import eventually

HELLO = [{"role": "user", "content": "Say hello"}]
REPLY = "one two three four five six seven"


class ChunkedWorker(FakeWorker):
    """Replies ``per`` tokens a message, with logprobs when asked; can fail after a few."""

    def __init__(
        self, worker_id: str, reply_ids: Sequence[int], *, per: int, fail_after: int = 0
    ) -> None:
        super().__init__(worker_id, reply_ids)
        self.per = per
        self.fail_after = fail_after  # messages sent before an INTERNAL error (0: none)
        self.sent: list[list[int]] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        ids = self.reply_ids
        parts = [ids[i : i + self.per] for i in range(0, len(ids), self.per)]
        for i, part in enumerate(parts):
            if self.fail_after and i == self.fail_after:
                await context.abort(grpc.StatusCode.INTERNAL, "scripted failure")
            last = i == len(parts) - 1
            msg = pb.GenerateResponse(token_ids=part, finished=last, worker_id=self.worker_id)
            if request.sampling.HasField("logprobs"):
                for t in part:  # the second alternative is impossible (a masked token)
                    msg.logprobs.add(logprob=-0.25, top_ids=[t, 7], top_logprobs=[-0.25, -math.inf])
            if i == 0:
                msg.usage.prompt_tokens = len(request.prompt_token_ids)
            if last:
                msg.finish_reason = "stop"
                msg.usage.prompt_tokens = len(request.prompt_token_ids)
                msg.usage.completion_tokens = len(ids)
            self.sent.append(part)
            yield msg


async def _add(h: Harness, worker_id: str, per: int, **kw: Any) -> ChunkedWorker:
    ids = [*h.tok.encode_text(REPLY), 2]  # then <|im_end|>
    worker = await ChunkedWorker(worker_id, ids, per=per, **kw).start()
    reg = FakeRegistration(h.redis, h.layout, worker_id, worker.address, SPEC)
    await reg.register()
    h.workers[worker_id] = (worker, reg)
    await eventually(lambda: worker_id in h.state.mirror.workers, what=worker_id)
    return worker


async def _events(resp: Any) -> list[bytes]:
    """The raw ``data:`` payloads, in order."""
    assert resp.status == 200, await resp.text()
    body = await resp.read()
    assert body.endswith(b"\n\n")
    events = body.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[len(b"data: ") :] for e in events]


def _content(events: list[bytes]) -> list[dict[str, Any]]:
    """The choice of every chunk that carries text."""
    out = []
    for raw in events[:-1]:
        for choice in json.loads(raw)["choices"]:
            if choice["delta"].get("content"):
                out.append(choice)
    return out


async def test_a_message_of_several_tokens_is_one_event(gateway: Harness) -> None:
    worker = await _add(gateway, "w1", per=3)
    events = await _events(await gateway.chat(HELLO, stream=True))
    assert events[-1] == b"[DONE]"
    texts = [c["delta"]["content"] for c in _content(events)]
    assert "".join(texts) == REPLY
    # Every message but the last (whose only text token is followed by <|im_end|>) is
    # one text event; the finish goes in its own event, as OpenAI sends it.
    assert len(texts) == len(worker.sent)
    finish = json.loads(events[-2])["choices"][0]
    assert finish == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert len(events) == 1 + len(texts) + 1 + 1  # role, text, finish, [DONE]


async def test_logprobs_come_one_per_token_in_the_event_of_their_message(
    gateway: Harness,
) -> None:
    worker = await _add(gateway, "w1", per=4)
    resp = await gateway.chat(HELLO, stream=True, logprobs=True, top_logprobs=2)
    events = await _events(resp)
    choices = _content(events)
    assert [len(c["logprobs"]["content"]) for c in choices] == [len(p) for p in worker.sent][
        : len(choices)
    ]
    first = choices[0]["logprobs"]["content"][0]
    assert first["logprob"] == -0.25 and len(first["top_logprobs"]) == 2
    assert b"-Infinity" in b"".join(events)  # -inf, as Python's json writes it


async def test_n_choices_each_message_is_one_event(gateway: Harness) -> None:
    worker = await _add(gateway, "w1", per=2)
    events = await _events(await gateway.chat(HELLO, stream=True, n=2))
    by_index: dict[int, list[str]] = {0: [], 1: []}
    for c in _content(events):
        by_index[c["index"]].append(c["delta"]["content"])
    assert {i: "".join(t) for i, t in by_index.items()} == {0: REPLY, 1: REPLY}
    assert len(by_index[0]) + len(by_index[1]) == len(worker.sent)


async def test_a_worker_failing_mid_stream_is_reported_in_band(gateway: Harness) -> None:
    await _add(gateway, "w1", per=2, fail_after=2)
    events = await _events(await gateway.chat(HELLO, stream=True))
    assert events[-1] == b"[DONE]"
    assert [c["delta"]["content"] for c in _content(events[:-1])]  # the text sent before it
    error = json.loads(events[-2])
    assert error["error"]["code"] == "worker_error", error


async def test_one_token_messages_are_one_event_each(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", "Hello 世界!")  # one token a message
    events = await _events(await gateway.chat(HELLO, stream=True, model=MODEL))
    texts = [c["delta"]["content"] for c in _content(events)]
    assert "".join(texts) == "Hello 世界!"
    assert len(texts) <= len(worker.reply_ids) - 1  # a split character waits for its rest


def test_auto_stream_interval_grows_with_the_open_streams() -> None:
    from gateway.routing.jobs import stream_interval

    assert [stream_interval(0, n) for n in (0, 1, 15, 16, 31, 32, 63, 64, 500)] == [
        1, 1, 1, 2, 3, 4, 7, 8, 8,
    ]  # fmt: skip
    assert stream_interval(3, 500) == stream_interval(3, 0) == 3  # fixed by --stream-interval
    # An answer read whole takes at least WHOLE_ANSWER_INTERVAL tokens a message.
    assert stream_interval(0, 0, whole_answer=True) == 16
    assert stream_interval(32, 0, whole_answer=True) == 32


async def test_the_gateway_asks_workers_for_its_stream_interval(
    make_gateway: Any,
) -> None:
    lightly = await make_gateway()
    worker, _ = await lightly.add_worker("w0", reply=REPLY)
    resp = await lightly.chat(HELLO, stream=True)
    assert resp.status == 200
    assert "[DONE]" in await resp.text()
    assert worker.requests[-1].stream_interval == 1  # one stream open: token by token
    # A JSON answer is collected whole: one message for the first token, then 16 a message.
    resp = await lightly.chat(HELLO)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == REPLY
    assert worker.requests[-1].stream_interval == 16
    # ... unless its text is read as it comes: for a stop string, or tool calls.
    assert (await lightly.chat(HELLO, stop=["zzz"])).status == 200
    assert worker.requests[-1].stream_interval == 1
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert (await lightly.chat(HELLO, tools=[tool])).status == 200
    assert worker.requests[-1].stream_interval == 1
    fixed = await make_gateway(stream_interval=4)
    worker, _ = await fixed.add_worker("w1", reply=REPLY)
    resp = await fixed.chat(HELLO, stream=True)
    assert resp.status == 200, await resp.text()
    assert "[DONE]" in await resp.text()
    assert worker.requests[-1].stream_interval == 4
    # 24 streams held open on one gateway: the next request asks for 3 tokens a message.
    fixed.state.dispatcher.stream_interval = 0
    fixed.state.dispatcher.open_streams = 24
    resp = await fixed.chat(HELLO, stream=True)
    assert "[DONE]" in await resp.text()
    assert worker.requests[-1].stream_interval == 3
    fixed.state.dispatcher.open_streams = 0
