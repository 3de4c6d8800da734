"""Protobuf messages on a plain TCP connection, each behind its 4-byte length.

The gateway's ``GenerateMany`` stream to a worker carries ``CallFrames`` one
way and ``ReplyFrames`` the other (``proto/worker.proto``); HTTP/2 and
grpc.aio around them cost the gateway about as much CPU as the rest of a
small request (``loadtest.bench_grpc_shapes``), and each message crosses
grpc's poller thread before the event loop sees it. A worker started with
``--frames-port`` also serves the same stream here: the same messages, each
written as ``length (uint32, big-endian) + serialized message``, read and
written by the event loop itself. The gateway's side ends its writing with a
TCP half-close, as it would end a gRPC stream's writing; either side closing
the connection ends the stream.

``FramedConnection`` is the asyncio protocol both ends use: ``read()`` the
next message (``EOF`` at a clean end), ``write()`` one. It has no notion of
calls; ``gateway.upstream.grpc_mux`` and ``worker.serve.frames_server`` give
the messages their meaning.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

HEADER = struct.Struct(">I")
# Far above any real message (a 128k-token prompt is ~600 kB): a larger length is a
# peer speaking another protocol, and the connection is dropped rather than buffered.
MAX_MESSAGE = 64 * 1024 * 1024
# Messages read but not yet taken: past this the socket is not read (TCP pushes back).
_READ_AHEAD = 1024

M = TypeVar("M")
EOF: Any = object()  # what ``read`` returns once the peer ended its side cleanly


class FrameError(ConnectionError):
    """The peer sent something that is not a length-prefixed message of the expected type."""


def encode(message: Any) -> bytes:
    """``message`` (a protobuf message, or one already serialized) behind its length."""
    body = message if isinstance(message, bytes) else message.SerializeToString()
    return HEADER.pack(len(body)) + body


class FramedConnection(asyncio.Protocol, Generic[M]):
    """One TCP connection carrying length-prefixed protobuf messages, parsed with ``parse``."""

    def __init__(self, parse: Callable[[bytes], M]) -> None:
        self._parse = parse
        self._buffer = bytearray()
        self._messages: deque[M] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # no more messages will arrive
        self._error: Exception | None = None  # why, when not a clean end
        self._paused_reading = False
        self._can_write: asyncio.Event = asyncio.Event()
        self._can_write.set()
        self.transport: asyncio.Transport | None = None
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if not self.connected.done():
            self.connected.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        start = 0
        while len(buf) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, start)
            if size > MAX_MESSAGE:
                self._fail(FrameError(f"a {size}-byte message is over the {MAX_MESSAGE} limit"))
                return
            end = start + HEADER.size + size
            if len(buf) < end:
                break
            try:
                self._messages.append(self._parse(bytes(buf[start + HEADER.size : end])))
            except Exception as exc:  # protobuf's DecodeError and kin
                self._fail(FrameError(f"a message could not be parsed: {exc}"))
                return
            start = end
        if start:
            del buf[:start]
        if len(self._messages) >= _READ_AHEAD and self.transport is not None:
            self.transport.pause_reading()
            self._paused_reading = True
        self._wake()

    def eof_received(self) -> bool:
        self._end(None)
        return True  # keep our side open: replies to calls already made still go out

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc if exc is not None else None)
        self._can_write.set()  # a blocked writer finds the connection gone
        if not self.connected.done():
            self.connected.set_exception(exc or ConnectionError("connection closed"))

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- the message stream ----------------------------------------------------------

    async def read(self) -> M:
        """The next message; ``EOF`` once the peer ended cleanly; raises if it did not."""
        while not self._messages:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return EOF  # type: ignore[no-any-return]
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._messages.popleft()
        if self._paused_reading and len(self._messages) < _READ_AHEAD // 2:
            self._paused_reading = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()
        return message

    async def write(self, message: Any) -> None:
        """Sends ``message``; waits while the peer is not reading (the socket buffer is full)."""
        if not self._can_write.is_set():
            await self._can_write.wait()
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        transport.write(encode(message))

    def done_writing(self) -> None:
        """Ends this side's messages (a TCP half-close); the peer's may still arrive."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write_eof()

    def close(self) -> None:
        """Drops the connection at once."""
        if self.transport is not None:
            self.transport.abort()
        self._end(ConnectionResetError("the connection was closed here"))

    # -- internals -------------------------------------------------------------------

    def _fail(self, error: Exception) -> None:
        self._end(error)
        if self.transport is not None:
            self.transport.abort()

    def _end(self, error: Exception | None) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
