"""A worker's ``GenerateMany`` stream on its frames port, shaped like the gRPC call.

``gateway.upstream.grpc_mux.MuxStream`` drives a ``grpc.aio`` stream-stream
call: ``write``, ``read`` (``grpc.aio.EOF`` at the end), ``done_writing`` and
``cancel``, failures raised as ``grpc.aio.AioRpcError``. ``FramedStream`` is
the same four methods over ``contract.frames`` on one TCP connection, so the
mux, its calls, deadlines, retries and draining stay exactly as they are. A
connection that cannot be made, or that drops, is the ``UNAVAILABLE`` a gRPC
channel to a dead worker gives: calls before their first token are retried on
another worker.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import grpc

from contract import frames
from contract import worker_pb2 as pb

CONNECT_TIMEOUT_S = 5.0
# A worker whose host vanished sends no reset: TCP keepalive finds it as gRPC's pings
# would (idle 30 s, then 3 probes 10 s apart), so its stream fails instead of hanging.
_KEEPALIVE = (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", 0), 30),
    (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", 0), 10),
    (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", 0), 3),
)


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
    )


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ``ValueError`` if it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


class FramedStream:
    """One connection to ``address`` carrying a ``GenerateMany`` stream; connects at once.

    ``on_unreachable`` is called once if the connection cannot be made (the calls
    waiting on the stream still fail as ``UNAVAILABLE``).
    """

    def __init__(
        self, address: str, on_unreachable: Callable[[BaseException], None] | None = None
    ) -> None:
        self.address = address
        self._on_unreachable = on_unreachable
        self._connecting = asyncio.ensure_future(self._connect())
        self._connecting.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Future[Any]) -> None:
        if self._on_unreachable is None or task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._on_unreachable(exc)

    async def _connect(self) -> frames.FramedConnection[pb.ReplyFrames]:
        host, port = split_address(self.address)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(
                lambda: frames.FramedConnection(pb.ReplyFrames.FromString), host, port
            ),
            CONNECT_TIMEOUT_S,
        )
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            for level, option, value in _KEEPALIVE:
                if option:  # an option this platform lacks is left at its default
                    sock.setsockopt(level, option, value)
        return conn

    async def _conn(self) -> frames.FramedConnection[pb.ReplyFrames]:
        try:
            return await asyncio.shield(self._connecting)
        except (OSError, TimeoutError, ValueError) as exc:
            raise _unavailable(f"frames connection to {self.address} failed: {exc}") from exc

    async def write(self, message: Any) -> None:
        conn = await self._conn()
        try:
            await conn.write(message)
        except ConnectionError as exc:
            raise _unavailable(f"frames connection to {self.address} lost: {exc}") from exc

    async def read(self) -> Any:
        conn = await self._conn()
        try:
            message = await conn.read()
        except ConnectionError as exc:
            raise _unavailable(f"frames connection to {self.address} lost: {exc}") from exc
        return grpc.aio.EOF if message is frames.EOF else message

    async def done_writing(self) -> None:
        (await self._conn()).done_writing()

    def cancel(self) -> None:
        if not self._connecting.done():
            self._connecting.cancel()
        elif not self._connecting.cancelled() and self._connecting.exception() is None:
            self._connecting.result().close()
