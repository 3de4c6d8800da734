"""The openai-http upstream against a fake ``/v1/completions`` on port 0 (vLLM's stream shape).

The chunk shapes are the ones vLLM 0.32 streams (docs/VLLM.md); tests/vllm runs
the same upstream against real vLLM.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from gateway.upstream.base import Chunk, Generation, UpstreamError
from gateway.upstream.openai_http import OpenAIHTTPUpstream, completion_body

GEN = Generation(
    request_id="r1",
    prompt_ids=[1, 2, 3],
    max_tokens=3,
    temperature=0.0,
    top_p=0.0,
    top_k=0,
    seed=7,
    ignore_eos=False,
    stop_token_ids=(2,),
    cache_salt="tenant-a",
)


def _chunk(ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": "x", "finish_reason": finish, "token_ids": ids}]}


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
}


class FakeWorker:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[str] = []
        self.script: list[Any] = []
        self.status = 200
        self.closed_early = asyncio.Event()
        self.done_written = asyncio.Event()  # set as [DONE] is written
        self.peers: set[Any] = set()  # client (host, port) per connection that sent a request

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        if self.status != 200:
            return web.json_response(
                {"error": {"message": "nope", "code": self.status}}, status=self.status
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for item in self.script:
                if item == "sleep":  # hold the stream open until the client goes away
                    for _ in range(100):
                        if request.transport is None or request.transport.is_closing():
                            self.closed_early.set()
                            return resp
                        await asyncio.sleep(0.05)
                    continue
                if item == "pause":  # a slow step
                    await asyncio.sleep(0.3)
                    continue
                if item == "cut":
                    return resp  # ends the stream without [DONE] or a finish
                if item == "[DONE]":
                    self.done_written.set()
                data = item if isinstance(item, str) else json.dumps(item)
                end = "\r\n\r\n" if isinstance(item, dict) and item.get("crlf") else "\n\n"
                await resp.write(f"data: {data}{end}".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            self.closed_early.set()
            raise
        return resp


@pytest.fixture
async def worker() -> AsyncIterator[tuple[FakeWorker, str]]:
    fake = FakeWorker()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, f"127.0.0.1:{port}"
    await runner.cleanup()


async def _all(upstream: OpenAIHTTPUpstream, address: str) -> list[Chunk]:
    call = upstream.start("w", address, GEN, 10.0)
    out = []
    while (c := await call.read()) is not None:
        out.append(c)
    return out


def test_request_body_carries_token_ids_and_sampling() -> None:
    body = completion_body(GEN)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True
    assert body["top_p"] == 1.0 and body["top_k"] == 0  # 0 = off in kvroute, vLLM's off values
    assert body["seed"] == 7 and body["stop_token_ids"] == [2] and body["cache_salt"] == "tenant-a"
    assert "cache_salt" not in completion_body(replace(GEN, cache_salt=""))
    assert "model" not in body  # vLLM serves one model and takes it as the default


async def test_stream_maps_tokens_finish_and_cached_tokens(worker: tuple[FakeWorker, str]) -> None:
    fake, address = worker
    usage = json.loads(json.dumps(USAGE))
    usage["usage"]["prompt_tokens_details"]["cached_tokens"] = 32
    script = [_chunk([5]), _chunk([]), _chunk([6, 7]), _chunk([8], "length"), usage, "[DONE]"]
    # A pause after each event: every event is its own chunk.
    fake.script = [x for item in script for x in (item, "pause")]
    up = OpenAIHTTPUpstream()
    chunks = await _all(up, address)
    assert chunks == [
        Chunk([5]),
        Chunk([6, 7]),
        Chunk([8], finished=True, finish_reason="length", cached_tokens=32),
    ]
    assert fake.bodies[0]["prompt"] == [1, 2, 3]
    # The gateway's request id (vLLM takes it as its own; a retry's is ``r1-<attempt>``).
    assert fake.request_ids[0] == "r1"
    # Events that arrive together are read as one chunk (the finish with what came before).
    fake.script = script
    assert await _all(up, address) == [
        Chunk([5, 6, 7, 8], finished=True, finish_reason="length", cached_tokens=32)
    ]
    await up.close()


async def test_events_that_piled_up_are_one_chunk_and_the_prompt_echo_is_ignored(
    worker: tuple[FakeWorker, str],
) -> None:
    # vLLM 0.32 echoes the prompt's ids in the first event of a return_token_ids stream;
    # a slow reader finds several token events waiting and relays them at once.
    fake, address = worker
    first = _chunk([5])
    first["choices"][0]["prompt_token_ids"] = list(range(6000))
    lp = {"token_logprobs": [-0.5], "top_logprobs": [{"token_id:6": -0.5}]}
    six, seven = _chunk([6]), _chunk([7], "stop")
    six["choices"][0]["logprobs"] = lp
    seven["choices"][0]["logprobs"] = {"token_logprobs": [-0.25], "top_logprobs": [None]}
    fake.script = [first, "pause", six, seven, USAGE, "[DONE]"]
    up = OpenAIHTTPUpstream()
    call = up.start("w", address, GEN, 10.0)
    assert await call.read() == Chunk([5])
    await asyncio.sleep(0.4)  # everything after the pause has arrived
    last = await call.read()
    assert last is not None and list(last.token_ids) == [6, 7] and last.finished
    assert last.cached_tokens == 0 and last.finish_reason == "stop"
    assert [(t.token_id, t.logprob) for t in last.logprobs] == [(6, -0.5), (7, -0.25)]
    assert await call.read() is None
    await up.close()


async def test_crlf_lines_and_an_error_after_tokens(worker: tuple[FakeWorker, str]) -> None:
    # Another server's CRLF line ends read as LF; an error event behind tokens that came
    # with it is raised after those tokens.
    fake, address = worker
    fake.script = [_chunk([5]) | {"crlf": True}, "pause", _chunk([6]), '{"error": "boom"}']
    up = OpenAIHTTPUpstream()
    call = up.start("w", address, GEN, 10.0)
    assert await call.read() == Chunk([5])
    await asyncio.sleep(0.4)
    assert await call.read() == Chunk([6])
    with pytest.raises(UpstreamError, match="boom"):
        await call.read()
    await up.close()


async def test_unknown_finish_reasons_become_stop(worker: tuple[FakeWorker, str]) -> None:
    fake, address = worker
    fake.script = [_chunk([2], "repetition"), "[DONE]"]  # no usage chunk at all
    up = OpenAIHTTPUpstream()
    assert await _all(up, address) == [Chunk([2], True, "stop", None)]
    await up.close()


@pytest.mark.parametrize(
    ("status", "retryable", "client_status"),
    [(400, False, 400), (503, True, 502), (404, True, 502)],
)
async def test_http_errors_before_the_first_token(
    worker: tuple[FakeWorker, str], status: int, retryable: bool, client_status: int
) -> None:
    fake, address = worker
    fake.status = status
    up = OpenAIHTTPUpstream()
    with pytest.raises(UpstreamError) as info:
        await _all(up, address)
    await up.close()
    assert info.value.retryable is retryable
    assert info.value.api_error.status == client_status


async def test_unreachable_worker_is_retryable() -> None:
    up = OpenAIHTTPUpstream(connect_timeout_s=0.5)
    with pytest.raises(UpstreamError) as info:
        await _all(up, "http://127.0.0.1:9")  # discard port: nothing listens
    await up.close()
    assert info.value.retryable


async def test_a_stream_cut_mid_answer_is_an_error(worker: tuple[FakeWorker, str]) -> None:
    fake, address = worker
    fake.script = [_chunk([5]), "cut"]
    up = OpenAIHTTPUpstream()
    call = up.start("w", address, GEN, 10.0)
    assert await call.read() == Chunk([5])
    with pytest.raises(UpstreamError):
        await call.read()
    await up.close()


async def test_cancel_closes_the_connection(worker: tuple[FakeWorker, str]) -> None:
    fake, address = worker
    fake.script = [_chunk([5]), "sleep", _chunk([6], "stop")]
    up = OpenAIHTTPUpstream()
    call = up.start("w", address, GEN, 10.0)
    assert await call.read() == Chunk([5])
    call.cancel()
    await asyncio.wait_for(fake.closed_early.wait(), 3.0)  # the worker saw its client go
    await up.close()


async def test_read_within_leaves_a_slow_stream_readable(worker: tuple[FakeWorker, str]) -> None:
    # The dispatcher polls for the first token every 0.25 s: a poll that times out must
    # not end the call, and a cancel after one still closes the connection.
    fake, address = worker
    fake.script = [_chunk([5]), "pause", _chunk([6], "stop"), USAGE, "[DONE]"]
    up = OpenAIHTTPUpstream()
    call = up.start("w", address, GEN, 10.0)
    assert await call.read_within(5.0) == Chunk([5])
    with pytest.raises(TimeoutError):
        await call.read_within(0.05)
    last = await call.read_within(5.0)
    assert last is not None and list(last.token_ids) == [6] and last.finished
    fake.script, fake.closed_early = [_chunk([5]), "sleep", _chunk([6], "stop")], asyncio.Event()
    call = up.start("w", address, GEN, 10.0)
    assert await call.read_within(5.0) == Chunk([5])
    with pytest.raises(TimeoutError):
        await call.read_within(0.05)
    call.cancel()
    await asyncio.wait_for(fake.closed_early.wait(), 3.0)
    await up.close()


async def test_a_finished_stream_leaves_its_connection_for_the_next(
    worker: tuple[FakeWorker, str],
) -> None:
    # A request to a vLLM worker must not pay for a new TCP connection each time.
    fake, address = worker
    fake.script = [_chunk([5]), _chunk([6], "stop"), USAGE, "[DONE]"]
    up = OpenAIHTTPUpstream()
    for _ in range(3):
        assert (await _all(up, address))[-1].finished
    await up.close()
    assert len(fake.bodies) == 3 and len(fake.peers) == 1


async def test_the_rest_of_a_response_is_read_behind_the_answer_and_its_connection_reused(
    worker: tuple[FakeWorker, str],
) -> None:
    # The usage ends the answer; [DONE] and the response's end come a moment later. The
    # answer does not wait for them, and the rest is read behind it, so the next request
    # finds the connection in the pool instead of opening another.
    fake, address = worker
    fake.script = [_chunk([5], "stop"), USAGE, "pause", "[DONE]"]
    up = OpenAIHTTPUpstream()
    for _ in range(2):
        fake.done_written.clear()
        assert await _all(up, address) == [Chunk([5], True, "stop", 0)]
        assert not fake.done_written.is_set()  # answered while the worker still paused
        await asyncio.wait_for(fake.done_written.wait(), 3.0)
        await asyncio.sleep(0.1)  # the response's end reaches the reader
    assert len(fake.bodies) == 2 and len(fake.peers) == 1
    await up.close()


def test_the_prompt_echo_is_cut_before_parsing() -> None:
    # vLLM's compact JSON; the token ids after the echo survive, other events are untouched.
    from gateway.upstream.openai_http import _without_prompt_echo

    event = {"choices": [{"index": 0, "prompt_token_ids": list(range(6000)), "token_ids": [7]}]}
    raw = json.dumps(event, separators=(",", ":")).encode()
    cut = json.loads(_without_prompt_echo(raw))
    assert cut["choices"][0] == {"index": 0, "prompt_token_ids": None, "token_ids": [7]}
    other = json.dumps(_chunk([5]), separators=(",", ":")).encode()
    assert _without_prompt_echo(other) == other
