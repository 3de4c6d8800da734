"""The gRPC upstream: kvroute workers, one ``grpc.aio`` channel per worker, reused.

Requests travel on the worker's one ``GenerateMany`` stream (``grpc_mux``), or
as a ``Generate`` call each where the worker lacks that RPC or ``mux`` is off.

A channel is created on first use and replaced when the worker's address
changes. When the worker leaves the registry (a drain deregisters first) the
channel takes no new calls but stays open for the calls still streaming on it,
up to ``drain_s`` (the request timeout): a rolling restart never cuts a
stream. A worker that advertises a frames port (``frames_address``) gets
its stream there instead, without HTTP/2 (``gateway.upstream.frames_call``),
unless this gateway talks TLS or sends a token to its workers (the frames
port has neither). gRPC statuses map to ``UpstreamError``s here, and so does a call that
ends in ``CancelledError`` although nobody cancelled the reading task (grpc
raises that when a channel closes under a call), so nothing above this module
imports grpc and no stream ends without an error event. With a shared token
(``--grpc-token-file``) every call carries ``authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from contract import prompt_wire, worker_pb2, worker_pb2_grpc
from contract.grpc_auth import METADATA_KEY, bearer
from gateway.upstream.base import (
    Chunk,
    Generation,
    PatientRead,
    UpstreamCall,
    UpstreamError,
)
from gateway.upstream.frames_call import FramedStream
from gateway.upstream.grpc_mux import MuxCall, MuxStream
from openai_api.errors import APIError
from openai_api.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)

_GENERATE_MANY = f"/{worker_pb2.DESCRIPTOR.services_by_name['Worker'].full_name}/GenerateMany"
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Fail fast when a worker is gone instead of waiting for reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# Failures after which another worker may well succeed.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}
_CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def _upstream_error(exc: grpc.aio.AioRpcError) -> UpstreamError:
    return status_error(exc.code(), exc.details() or "")


def status_error(code: grpc.StatusCode, details: str) -> UpstreamError:
    """The ``UpstreamError`` for a call that ended with gRPC status ``code``."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        api = APIError(504, "the request timed out", code="timeout")
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        # A deployment mistake, not the client's: say which flag to look at.
        logger.error(
            "a worker refused this gateway's token (%s): give gateways and workers the "
            "same --grpc-token-file",
            details,
        )
        api = APIError(502, "the worker refused the gateway's credentials", code="worker_error")
    elif code in _CLIENT_ERRORS:
        api = APIError(400, f"the worker rejected the request: {details}", code="invalid_request")
    else:
        api = APIError(502, f"worker error {code.name}: {details}", code="worker_error")
    return UpstreamError(f"{code.name}: {details}", retryable=code in _RETRYABLE, api_error=api)


def to_chunk(msg: worker_pb2.GenerateResponse) -> Chunk:
    """A worker message as a ``Chunk`` (per message, so kept lean)."""
    # Usage only on the first and last messages, logprobs only if asked.
    cached = None
    if msg.HasField("usage") and (msg.usage.prompt_tokens or msg.usage.cached_tokens):
        cached = int(msg.usage.cached_tokens)
    logprobs: tuple[TokenLogprobs, ...] = ()
    if msg.logprobs:
        logprobs = tuple(
            TokenLogprobs(t, lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs, strict=True)))
            for t, lp in zip(msg.token_ids, msg.logprobs, strict=False)
        )
    return Chunk(
        token_ids=msg.token_ids,
        finished=msg.finished,
        finish_reason=msg.finish_reason,
        cached_tokens=cached,
        logprobs=logprobs,
    )


def _request(g: Generation, *, le32: bool = False) -> worker_pb2.GenerateRequest:
    sampling = worker_pb2.SamplingParams(
        max_tokens=g.max_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        ignore_eos=g.ignore_eos,
        stop_token_ids=list(g.stop_token_ids),
    )
    if g.seed is not None:
        sampling.seed = g.seed
    sampling.presence_penalty = g.presence_penalty
    sampling.frequency_penalty = g.frequency_penalty
    sampling.repetition_penalty = g.repetition_penalty
    sampling.min_p = g.min_p
    sampling.logit_bias.update(dict(g.logit_bias))
    if g.logprobs is not None:
        sampling.logprobs = g.logprobs
    if g.json_schema is not None:
        sampling.json_schema = g.json_schema
    if g.grammar is not None:
        sampling.grammar = g.grammar
    request = worker_pb2.GenerateRequest(
        request_id=g.request_id,
        sampling=sampling,
        cache_salt=g.cache_salt,
        stream_interval=g.stream_interval,
    )
    if le32:
        request.prompt_token_ids_le32 = prompt_wire.le32(g.prompt_ids)
    else:
        request.prompt_token_ids.extend(g.prompt_ids)
    return request


def _cut_off() -> UpstreamError:
    return UpstreamError(
        "the call was cancelled by its channel",
        retryable=True,
        api_error=APIError(502, "the connection to the worker was lost", code="worker_error"),
    )


class _GrpcCall:
    """One ``Generate`` stream as ``Chunk``s."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._cancelled = False
        self._patient = PatientRead(self.read)

    async def read(self) -> Chunk | None:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _upstream_error(exc) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._cancelled or (task is not None and task.cancelling()):
                raise  # our own cancel(), or the request's task is being cancelled
            raise _cut_off() from None
        if msg is grpc.aio.EOF:
            return None
        return to_chunk(msg)

    async def read_within(self, limit_s: float) -> Chunk | None:
        return await self._patient.within(limit_s)

    def cancel(self) -> None:
        self._cancelled = True
        self._patient.cancel()
        self._call.cancel()


@dataclass
class _Worker:
    """The channel to one worker's address, its stub and its ``GenerateMany`` stream."""

    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    frames_address: str = ""  # its stream goes here when set (never with TLS or a token)
    frames_unreachable: bool = False  # a connection there failed: gRPC from then on
    mux: MuxStream | None = None
    generate_many: Any = None  # GenerateMany taking serialized CallFrames


class GrpcUpstream:
    """Worker id -> a live stub on a channel to that worker's address.

    With ``mux`` (the default) every request to a worker travels on that
    worker's one ``GenerateMany`` stream (``gateway.upstream.grpc_mux``); a
    worker that lacks the RPC gets a ``Generate`` call per request, as every
    worker does without ``mux``.
    """

    def __init__(
        self,
        tls_ca: bytes | None = None,
        *,
        drain_s: float = 600.0,
        token: str = "",
        mux: bool = True,
        frames: bool = True,
    ) -> None:
        self.drain_s = drain_s  # how long a forgotten channel stays open for its calls
        self.mux = mux
        # The frames port has no TLS and no token: a gateway that uses either keeps gRPC.
        self.frames = frames and mux and not tls_ca and not token
        # Call metadata rather than call credentials: those need TLS, the token does not.
        self._metadata = ((METADATA_KEY, bearer(token)),) if token else None
        # With a CA bundle every worker channel is TLS, verified against it.
        self._credentials = grpc.ssl_channel_credentials(tls_ca) if tls_ca else None
        self._workers: dict[str, _Worker] = {}
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    def worker(self, worker_id: str, address: str, frames_address: str = "") -> _Worker:
        """The channel to ``worker_id`` at ``address`` (a new one if the address moved)."""
        if not self.frames:
            frames_address = ""
        entry = self._workers.get(worker_id)
        if entry is not None and (entry.address, entry.frames_address) == (
            address,
            frames_address,
        ):
            return entry
        if entry is not None:
            self._close_later(entry)
        if self._credentials is not None:
            channel = grpc.aio.secure_channel(address, self._credentials, options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        entry = _Worker(address, channel, worker_pb2_grpc.WorkerStub(channel), frames_address)
        # The mux writes CallFrames already serialized (``contract.call_frames``).
        entry.generate_many = channel.stream_stream(
            _GENERATE_MANY, response_deserializer=worker_pb2.ReplyFrames.FromString
        )
        self._workers[worker_id] = entry
        return entry

    def stub(self, worker_id: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """The stub for ``worker_id`` at ``address``."""
        return self.worker(worker_id, address).stub

    def start(
        self,
        worker_id: str,
        address: str,
        generation: Generation,
        timeout_s: float,
        *,
        frames_address: str = "",
        prompt_encoding: str = "",
    ) -> UpstreamCall:
        """Starts the generation on the worker; the first ``read`` waits for its first tokens.

        ``prompt_encoding`` is the worker record's: "le32" sends the prompt as bytes.
        """
        entry = self.worker(worker_id, address, frames_address)
        request = _request(generation, le32=prompt_encoding == prompt_wire.PROMPT_LE32)
        mux = self._usable_mux(entry)
        if mux is None:
            return self._generate(entry.stub, request, timeout_s)
        return mux.start(request, timeout_s)

    def connect(self, worker_id: str, address: str, *, frames_address: str = "") -> None:
        """Opens the connection (and stream) to a worker that just joined, so that its
        first request does not wait for the handshakes."""
        entry = self.worker(worker_id, address, frames_address)
        mux = self._usable_mux(entry)
        if mux is not None:
            mux.open()
        else:
            entry.channel.get_state(try_to_connect=True)

    def _usable_mux(self, entry: _Worker) -> MuxStream | None:
        """The worker's ``GenerateMany`` stream (a new one in place of a lost one), or
        None where requests go as ``Generate`` calls: mux off, or the worker lacks it."""
        if not self.mux:
            return None
        if entry.mux is not None and entry.mux.dead:
            if entry.mux.unimplemented:
                return None
            entry.mux = None
        if entry.mux is None:
            entry.mux = self._open_mux(entry)
        return entry.mux

    def _generate(
        self,
        stub: worker_pb2_grpc.WorkerStub,
        request: worker_pb2.GenerateRequest,
        timeout_s: float,
    ) -> _GrpcCall:
        return _GrpcCall(stub.Generate(request, timeout=timeout_s, metadata=self._metadata))

    def _open_mux(self, entry: _Worker) -> MuxStream:
        def fall_back(waiting: list[MuxCall]) -> None:
            logger.info(
                "worker at %s has no GenerateMany: one Generate call per request", entry.address
            )
            for call in waiting:
                call.become(self._generate(entry.stub, call.request, call.timeout_s))

        def frames_unreachable(exc: BaseException) -> None:
            # A port the network does not let through (a policy that opens only gRPC's)
            # must not take the worker out of service: its later streams go over gRPC.
            logger.warning(
                "frames port %s of the worker at %s unreachable (%s): using gRPC",
                entry.frames_address,
                entry.address,
                exc,
            )
            entry.frames_unreachable = True

        def open_stream() -> Any:
            if entry.frames_address and not entry.frames_unreachable:
                return FramedStream(entry.frames_address, frames_unreachable)
            return entry.generate_many(metadata=self._metadata)

        return MuxStream(
            open_stream,
            status_error=status_error,
            to_chunk=to_chunk,
            on_unimplemented=fall_back,
        )

    def forget(self, worker_id: str) -> None:
        """Retires the channel of a worker that left: no new calls; running ones finish.

        The worker's ``GenerateMany`` stream is closed from this side once its
        calls have ended (up to ``drain_s``), and ``Channel.close(grace)``
        waits for the ``Generate`` calls in flight on it; so a draining
        worker's streams run to completion, while a dead worker's streams
        fail on their own first.
        """
        entry = self._workers.pop(worker_id, None)
        if entry is not None:
            self._close_later(entry)

    async def close(self) -> None:
        """Closes every channel."""
        entries = list(self._workers.values())
        self._workers.clear()
        for entry in entries:
            if entry.mux is not None:
                await entry.mux.close()
        # Retiring channels too: the gateway is stopping, it waits for nobody's drain.
        channels = [e.channel for e in entries] + list(self._closing.values())
        for channel in channels:
            await channel.close(grace=None)
        for task in list(self._closing):
            task.cancel()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._workers)

    def _close_later(self, entry: _Worker) -> None:
        task = asyncio.get_running_loop().create_task(self._retire(entry))
        self._closing[task] = entry.channel
        task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def _retire(self, entry: _Worker) -> None:
        if entry.mux is not None:
            await entry.mux.retire(self.drain_s)
        await entry.channel.close(grace=self.drain_s)
