"""The gRPC upstream's ``GenerateMany`` streams, against real gRPC servers (port 0).

Every request to a worker rides its one stream, each call reads exactly the
chunks and errors a ``Generate`` call would; a deadline, a cancel, a lost
worker and a worker without the RPC all behave as they do with one call per
request; a retired worker's stream closes once its calls ended. The tests
that take ``transport`` run twice: the stream on gRPC, and on the worker's
frames port (``contract.frames``), which must behave identically.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from contract import prompt_wire, worker_pb2_grpc
from contract import worker_pb2 as pb
from gateway.upstream.base import Chunk, Generation, UpstreamCall, UpstreamError
from gateway.upstream.grpc_worker import GrpcUpstream
from loadtest.scale_dispatcher import greedy_generation
from tests.gateway.fakes import FakeWorker
from tests.gateway.helpers import eventually

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["grpc", "frames"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _start(
    upstream: GrpcUpstream, worker: FakeWorker, generation: Generation, timeout_s: float
) -> UpstreamCall:
    """A call to ``worker`` on whichever stream it offers (its frames port when it has one)."""
    return upstream.start(
        worker.worker_id,
        worker.address,
        generation,
        timeout_s,
        frames_address=worker.frames_address,
    )


def _generation(prompt: Sequence[int], request_id: str = "r") -> Generation:
    return greedy_generation(request_id, list(prompt))


async def _read_all(call: UpstreamCall) -> list[Chunk]:
    chunks = []
    while (chunk := await call.read()) is not None:
        chunks.append(chunk)
    return chunks


class EchoWorker(FakeWorker):
    """Replies each request's own prompt back, one token a message; counts its streams."""

    def __init__(self, worker_id: str, **kw: object) -> None:
        super().__init__(worker_id, **kw)  # type: ignore[arg-type]
        self.streams = 0  # GenerateMany calls open now
        self.streams_opened = 0
        self.generate_calls = 0
        self.le32_requests = 0

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.generate_calls += 1
        self.reply_ids = prompt_wire.prompt_ids(request)
        self.le32_requests += bool(request.prompt_token_ids_le32)
        async for msg in super().Generate(request, context):
            yield msg

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.CallFrames], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReplyFrames]:
        self.streams += 1
        self.streams_opened += 1
        try:
            async for msg in super().GenerateMany(request_iterator, context):
                yield msg
        finally:
            self.streams -= 1


class GenerateOnly(worker_pb2_grpc.WorkerServicer):
    """A worker of an older release: ``Generate`` only."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        yield pb.GenerateResponse(
            token_ids=list(request.prompt_token_ids), finished=True, finish_reason="stop"
        )


async def test_concurrent_requests_share_one_stream_and_get_their_own_replies(
    transport: str,
) -> None:
    worker = await EchoWorker("w1").start(frames=transport == "frames")
    upstream = GrpcUpstream()
    try:
        calls = [
            _start(upstream, worker, _generation([i, i + 1, i + 2], f"r{i}"), 10)
            for i in range(0, 90, 3)
        ]
        results = await asyncio.gather(*(_read_all(c) for c in calls))
        for i, chunks in zip(range(0, 90, 3), results, strict=True):
            assert [t for c in chunks for t in c.token_ids] == [i, i + 1, i + 2]
            assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
        assert worker.streams_opened == 1 and worker.generate_calls == 30
        assert worker.completed == 30
        if transport == "frames":  # and that one stream was the frames connection
            assert worker.frames is not None and worker.frames.connections == 1
            # with TCP keepalive on, so a vanished worker host fails it instead of hanging
            stream = upstream.worker("w1", worker.address, worker.frames_address).mux
            assert stream is not None
            conn = await stream._call._conn()
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    finally:
        await upstream.close()
        await worker.stop()


async def test_a_worker_status_is_the_same_upstream_error_as_with_generate(transport: str) -> None:
    worker = await FakeWorker("w1", fail=grpc.StatusCode.INVALID_ARGUMENT).start(
        frames=transport == "frames"
    )
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1, 2]), 10)
        with pytest.raises(UpstreamError) as err:
            await call.read()
        assert not err.value.retryable
        assert err.value.api_error.status == 400
        assert "scripted failure" in err.value.message
    finally:
        await upstream.close()
        await worker.stop()


async def test_the_deadline_fails_the_call_and_aborts_it_on_the_worker(transport: str) -> None:
    worker = await FakeWorker("w1", [5, 6, 7], delay_s=5.0).start(frames=transport == "frames")
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1]), 0.2)
        with pytest.raises(UpstreamError) as err:
            await call.read()
        assert err.value.api_error.status == 504
        assert err.value.api_error.code == "timeout"
        await eventually(lambda: worker.cancelled == 1, what="the worker's call cancelled")
    finally:
        await upstream.close()
        await worker.stop()


async def test_read_within_times_out_a_silent_worker_and_the_call_goes_on(transport: str) -> None:
    # The dispatcher's inter-token timeout: nothing within the limit is a TimeoutError,
    # a chunk already here or arriving in time is read, and a cancel still cancels.
    worker = await FakeWorker("w1", [5, 6, 7, 8, 9], delay_s=0.4).start(
        frames=transport == "frames"
    )
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1]), 10)
        with pytest.raises(TimeoutError):
            await call.read_within(0.05)
        first = await call.read_within(5.0)
        assert first is not None and list(first.token_ids) == [5]
        await asyncio.sleep(0.9)  # the next two are here before they are read
        here = [await call.read_within(0.001) for _ in range(2)]
        assert [list(c.token_ids) for c in here if c is not None] == [[6], [7]]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read_within(5.0)
        # one Generate call per request (no stream): the same TimeoutError
        single = GrpcUpstream(mux=False)
        try:
            with pytest.raises(TimeoutError):
                await _start(single, worker, _generation([2]), 10).read_within(0.05)
        finally:
            await single.close()
    finally:
        await upstream.close()
        await worker.stop()


async def test_cancel_aborts_the_call_on_the_worker_and_the_stream_goes_on(transport: str) -> None:
    worker = await FakeWorker("w1", list(range(100, 140)), delay_s=0.05).start(
        frames=transport == "frames"
    )
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1]), 10)
        first = await call.read()
        assert first is not None and list(first.token_ids) == [100]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        await eventually(lambda: worker.cancelled == 1, what="the worker's call cancelled")
        worker.delay_s = 0.0
        again = await _read_all(_start(upstream, worker, _generation([2]), 10))
        assert len(again) == 40 and worker.completed == 1
    finally:
        await upstream.close()
        await worker.stop()


async def test_connect_opens_the_stream_before_the_first_request(transport: str) -> None:
    worker = await EchoWorker("w1").start(frames=transport == "frames")
    upstream = GrpcUpstream()
    try:
        upstream.connect(worker.worker_id, worker.address, frames_address=worker.frames_address)
        await eventually(lambda: worker.streams == 1, what="the stream open before a request")
        upstream.connect(worker.worker_id, worker.address, frames_address=worker.frames_address)
        served = await _read_all(_start(upstream, worker, _generation([7, 8]), 5))
        assert [t for c in served for t in c.token_ids] == [7, 8]
        assert worker.streams_opened == 1  # a second connect and the request reuse it
    finally:
        await upstream.close()
        await worker.stop()


async def test_a_worker_whose_record_says_le32_gets_the_prompt_as_bytes(transport: str) -> None:
    worker = await EchoWorker("w1").start(frames=transport == "frames")
    upstream = GrpcUpstream()
    try:
        for encoding in ("", prompt_wire.PROMPT_LE32):
            call = upstream.start(
                worker.worker_id,
                worker.address,
                _generation([5, 70000, 2**31]),
                5,
                frames_address=worker.frames_address,
                prompt_encoding=encoding,
            )
            served = await _read_all(call)
            assert [t for c in served for t in c.token_ids] == [5, 70000, 2**31]
        assert worker.generate_calls == 2 and worker.le32_requests == 1
    finally:
        await upstream.close()
        await worker.stop()


async def test_a_lost_worker_fails_its_calls_retryably_and_a_new_stream_opens(
    transport: str,
) -> None:
    worker = await EchoWorker("w1", delay_s=0.5).start(frames=transport == "frames")
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1, 2, 3]), 10)
        await eventually(lambda: worker.streams == 1, what="the stream open on the worker")
        await worker.stop()
        with pytest.raises(UpstreamError) as err:
            await _read_all(call)
        assert err.value.retryable
        # The same addresses come back: the next request opens a new stream there.
        worker.delay_s = 0.0
        await worker.start(frames=transport == "frames")

        served: list[Chunk] = []
        for _ in range(50):  # the channel may still be backing off from the lost connection
            try:
                served = await _read_all(_start(upstream, worker, _generation([4]), 2))
                break
            except UpstreamError:
                await asyncio.sleep(0.2)
        assert [t for c in served for t in c.token_ids] == [4]
        assert worker.streams_opened == 2
    finally:
        await upstream.close()
        await worker.stop()


async def test_a_worker_without_the_rpc_gets_one_generate_call_per_request() -> None:
    servicer = GenerateOnly()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upstream = GrpcUpstream()
    try:
        address = f"127.0.0.1:{port}"
        # The first requests wait on a stream the worker refuses, then start again as Generate.
        first = [upstream.start("old", address, _generation([i]), 10) for i in range(3)]
        results = await asyncio.gather(*(_read_all(c) for c in first))
        assert [list(r[0].token_ids) for r in results] == [[0], [1], [2]]
        later = await _read_all(upstream.start("old", address, _generation([9]), 10))
        assert list(later[0].token_ids) == [9] and servicer.calls == 4
    finally:
        await upstream.close()
        await server.stop(None)


async def test_without_mux_every_request_is_its_own_generate_call() -> None:
    worker = await EchoWorker("w1").start()
    upstream = GrpcUpstream(mux=False)
    try:
        chunks = await _read_all(upstream.start("w1", worker.address, _generation([3, 4]), 10))
        assert [t for c in chunks for t in c.token_ids] == [3, 4]
        assert worker.streams_opened == 0 and worker.generate_calls == 1
    finally:
        await upstream.close()
        await worker.stop()


async def test_a_forgotten_worker_finishes_its_calls_then_its_stream_closes(transport: str) -> None:
    worker = await EchoWorker("w1", delay_s=0.1).start(frames=transport == "frames")
    upstream = GrpcUpstream(drain_s=10)
    try:
        call = _start(upstream, worker, _generation([1, 2, 3, 4, 5]), 10)
        await eventually(lambda: worker.streams == 1, what="the stream open on the worker")
        upstream.forget("w1")
        chunks = await _read_all(call)
        assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5]
        await eventually(lambda: worker.streams == 0, what="the retired stream closed")
        assert len(upstream) == 0
    finally:
        await upstream.close()
        await worker.stop()


async def test_closing_the_upstream_fails_the_calls_waiting_on_it_at_once(transport: str) -> None:
    worker = await FakeWorker("w1", [5, 6], delay_s=5.0).start(frames=transport == "frames")
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1]), 60)
        reading = asyncio.ensure_future(call.read())
        await eventually(lambda: worker.requests, what="the call on the worker")
        await upstream.close()
        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(reading, 2)  # not the 60 s deadline
        assert err.value.retryable
    finally:
        await worker.stop()


async def test_an_unreachable_frames_port_fails_retryably_then_grpc_serves() -> None:
    # A network that lets only gRPC's port through must not take the worker out of service.
    worker = await EchoWorker("w1").start(frames=True)
    assert worker.frames is not None
    await worker.frames.stop(0)  # the frames port closes, gRPC stays
    upstream = GrpcUpstream()
    try:
        call = _start(upstream, worker, _generation([1]), 10)
        with pytest.raises(UpstreamError) as err:
            await call.read()
        assert err.value.retryable and "frames connection" in err.value.message
        chunks = await _read_all(_start(upstream, worker, _generation([5, 6]), 10))
        assert [t for c in chunks for t in c.token_ids] == [5, 6]
        assert worker.streams_opened == 1  # the gRPC stream
    finally:
        await upstream.close()
        await worker.stop()


@pytest.mark.parametrize("secured", [{"token": "s3cret"}, {"frames": False}])
async def test_a_gateway_with_a_token_or_frames_off_keeps_grpc(secured: dict[str, object]) -> None:
    # The frames port checks no token: a gateway that sends one never uses it.
    worker = await EchoWorker("w1").start(frames=True)
    upstream = GrpcUpstream(**secured)  # type: ignore[arg-type]
    try:
        chunks = await _read_all(_start(upstream, worker, _generation([7, 8]), 10))
        assert [t for c in chunks for t in c.token_ids] == [7, 8]
        assert worker.streams_opened == 1  # the gRPC stream: the servicer counts both kinds
        assert worker.frames is not None and worker.frames.connections == 0
    finally:
        await upstream.close()
        await worker.stop()
