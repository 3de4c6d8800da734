"""One ``GenerateMany`` stream per worker channel, carrying every request to that worker.

A ``Generate`` call per request costs the gateway an HTTP/2 stream, its
headers, a deadline and a status; one long-lived stream with a call id in
each frame costs about half (``loadtest.bench_grpc_shapes``). ``MuxStream``
keeps today's per-call semantics on top of it:

- each ``MuxCall`` reads ``Chunk``s and ``UpstreamError``s exactly as a
  ``Generate`` call's would be read (statuses arrive as status frames);
- its deadline is a timer that fails it with ``DEADLINE_EXCEEDED`` and sends a
  cancel frame; ``cancel()`` sends a cancel frame, which aborts the request on
  the worker;
- a lost stream fails every call on it as the lost call would have failed
  (retryable before the first token, in-band after it); the next request
  opens a new stream;
- a worker without the RPC answers ``UNIMPLEMENTED``: the calls waiting on
  the stream start again as ``Generate`` calls, and so does every later one
  (``on_unimplemented``);
- a retired stream (the worker left the registry) takes no new calls and is
  closed from the gateway's side once its calls have ended;
- however the stream ends, every call still waiting on it fails.

Frames ready at the same time are written as one message. Frames are kept
serialized (``contract.call_frames``): the stream's write takes the bytes of a
``CallFrames`` message, not the message.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from contract import call_frames
from contract import worker_pb2 as pb
from gateway.upstream.base import Chunk, UpstreamError

logger = logging.getLogger(__name__)

# Maps a status (code, details) to the error a lost or failed call raises.
StatusError = Callable[[grpc.StatusCode, str], UpstreamError]
# Converts a worker's GenerateResponse to a Chunk.
ToChunk = Callable[[pb.GenerateResponse], Chunk]

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class MuxCall:
    """One request on a ``MuxStream``: the ``UpstreamCall`` the dispatcher reads."""

    __slots__ = (
        "_cancelled",
        "_delegate",
        "_ended",
        "_items",
        "_stream",
        "_waiter",
        "call_id",
        "request",
        "timeout_s",
        "timer",
    )

    def __init__(
        self, stream: MuxStream, call_id: int, request: pb.GenerateRequest, timeout_s: float
    ) -> None:
        self._stream = stream
        self.call_id = call_id
        self.request = request
        self.timeout_s = timeout_s
        self._items: deque[Chunk | UpstreamError | None] = deque()  # None: end of stream
        self._waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self._ended = False  # the worker ended it, it failed, or it was cancelled
        self._cancelled = False
        self._delegate: Any = None  # the Generate call it became on a worker without the RPC

    async def read(self) -> Chunk | None:
        """The next chunk, or None at the end of the stream; raises ``UpstreamError``."""
        while not self._items:
            if self._delegate is not None:
                return await self._delegate.read()  # type: ignore[no-any-return]
            if self._cancelled:
                raise asyncio.CancelledError
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        return self._pop()

    async def read_within(self, limit_s: float) -> Chunk | None:
        """``read``, or ``TimeoutError`` when nothing arrives within ``limit_s``.

        A chunk already here needs no timer, and one the call waits for needs a
        single timer handle on its waiter. ``asyncio.timeout`` around every read
        cost 4.4 us a chunk (2.1 for a bare timer handle); without it the
        gateway's CPU per streamed token fell 10-15 % (``loadtest.bench_overhead``
        ``stream_128``).
        """
        while not self._items:
            if self._delegate is not None:
                return await self._delegate.read_within(limit_s)  # type: ignore[no-any-return]
            if self._cancelled:
                raise asyncio.CancelledError
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiter = waiter
            timer = loop.call_later(limit_s, _time_out, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._pop()

    def _pop(self) -> Chunk | None:
        item = self._items.popleft()
        if isinstance(item, UpstreamError):
            raise item
        return item

    def cancel(self) -> None:
        """Ends the call; a running generation is aborted on the worker."""
        self._cancelled = True
        if self._delegate is not None:
            self._delegate.cancel()
        if not self._ended:
            self._end()
            self._stream.cancel_call(self.call_id)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()

    # -- fed by the stream -------------------------------------------------------

    def deliver(self, item: Chunk | UpstreamError | None, *, last: bool = False) -> None:
        if self._ended:
            return
        self._items.append(item)
        if last:
            self._end()
        self._wake()

    def become(self, delegate: Any) -> None:
        """Continues as ``delegate`` (a ``Generate`` call): the stream had no such RPC."""
        self._end()
        if self._cancelled:
            delegate.cancel()
        self._delegate = delegate
        self._wake()

    def expire(self, error: UpstreamError) -> None:
        """The deadline passed: fail the call and tell the worker to stop it."""
        self.timer = None
        if self._ended:
            return
        self.deliver(error, last=True)
        self._stream.cancel_call(self.call_id)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self) -> None:
        self._ended = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._stream.calls.pop(self.call_id, None)


class MuxStream:
    """The ``GenerateMany`` stream to one worker, opened by ``open`` or on first use."""

    def __init__(
        self,
        open_stream: Callable[[], Any],
        *,
        status_error: StatusError,
        to_chunk: ToChunk,
        on_unimplemented: Callable[[list[MuxCall]], None],
    ) -> None:
        self._open_stream = open_stream
        self._status_error = status_error
        self._to_chunk = to_chunk
        self._on_unimplemented = on_unimplemented
        self.calls: dict[int, MuxCall] = {}
        self._next_id = 1
        self._call: Any = None  # the grpc.aio StreamStreamCall, once opened
        self._outbox: list[bytes] = []  # serialized CallFrames not yet written
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.dead = False  # lost or unimplemented: the upstream opens another
        self.unimplemented = False  # the worker has no GenerateMany
        self._closing = False  # retired: the writer ends the gateway's side when it is done

    def start(self, request: pb.GenerateRequest, timeout_s: float) -> MuxCall:
        """Sends ``request`` as a new call on this stream."""
        self.open()
        call_id = self._next_id
        self._next_id += 1
        call = MuxCall(self, call_id, request, timeout_s)
        self.calls[call_id] = call
        call.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, call)
        self._send(call_frames.start_frame(call_id, request.SerializeToString()))
        return call

    def _expire(self, call: MuxCall) -> None:
        call.expire(self._status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel_call(self, call_id: int) -> None:
        self.calls.pop(call_id, None)
        if not self.dead:
            self._send(call_frames.cancel_frame(call_id))

    async def retire(self, within_s: float) -> None:
        """Takes no new calls; waits up to ``within_s`` for the running ones, then closes
        the gateway's side, which ends the stream on the worker."""
        if self._call is None or self.dead:
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within_s
        while self.calls and not self.dead and loop.time() < give_up:
            await asyncio.sleep(0.05)
        self._closing = True  # the writer closes its side once the outbox is sent
        self._wake.set()

    async def close(self) -> None:
        """Cancels the stream at once (the gateway is stopping)."""
        self.dead = True
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the stream's two tasks ----------------------------------------------------

    def open(self) -> None:
        """Opens the stream (connecting to the worker) unless it is open already."""
        if self._call is not None:
            return
        self._call = self._open_stream()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_loop()), loop.create_task(self._read_loop())]

    def _send(self, frame: bytes) -> None:
        self._outbox.append(frame)
        self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._outbox:
                    frames, self._outbox = self._outbox, []
                    await self._call.write(call_frames.call_frames(frames))
                if self._closing:
                    await self._call.done_writing()
                    return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The read side sees the same end of the stream, with its status.
            logger.debug("GenerateMany write ended: %r", exc)

    async def _read_loop(self) -> None:
        # However the stream ends, the calls still on it fail as their own calls would have.
        error = self._status_error(grpc.StatusCode.CANCELLED, "the stream to the worker was closed")
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    break
                for frame in msg.frames:
                    self._deliver(frame)
            error = self._status_error(grpc.StatusCode.UNAVAILABLE, "the worker ended the stream")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._fall_back()
                return
            error = self._status_error(exc.code(), exc.details() or "")
        except Exception as exc:  # a malformed message: this stream cannot be trusted further
            logger.exception("GenerateMany stream failed")
            error = self._status_error(grpc.StatusCode.UNKNOWN, repr(exc))
        finally:
            self.dead = True
            self._tasks[0].cancel()  # the writer: nothing it holds can be delivered now
            for call in list(self.calls.values()):
                call.deliver(error, last=True)
            self.calls.clear()

    def _deliver(self, frame: pb.ReplyFrame) -> None:
        call = self.calls.get(frame.call_id)
        if call is None:
            return  # cancelled or expired here already
        if frame.HasField("response"):
            chunk = self._to_chunk(frame.response)
            call.deliver(chunk)
            if chunk.finished:
                call.deliver(None, last=True)
            return
        code = _CODES.get(frame.status.code, grpc.StatusCode.UNKNOWN)
        if code == grpc.StatusCode.OK:
            call.deliver(None, last=True)
        else:
            call.deliver(self._status_error(code, frame.status.details), last=True)

    def _fall_back(self) -> None:
        waiting = list(self.calls.values())
        self.calls.clear()
        self.dead = self.unimplemented = True
        self._on_unimplemented(waiting)
