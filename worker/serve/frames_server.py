"""``GenerateMany`` on a plain TCP port: the worker's side of ``contract.frames``.

Each connection is one ``GenerateMany`` stream, served by the very method the
gRPC server runs (``worker.serve.grpc_mux``): ``CallFrames`` read from the
socket feed it, the ``ReplyFrames`` it yields are written back. So a framed
call answers, fails, is cancelled and is refused while draining exactly as on
gRPC. The gateway half-closing the connection ends the stream once its calls
have ended; the connection dropping aborts every call still running on it.

There is no TLS and no token check here: a worker with ``--tls-cert`` or
``--grpc-token-file`` refuses ``--frames-port`` (``worker.serve.config``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from contract import frames
from contract import worker_pb2 as pb

logger = logging.getLogger(__name__)


class _StreamContext:
    """What ``GenerateMany`` asks of a gRPC stream's context, for a TCP connection."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return self._peer


class FramesServer:
    """Serves ``service.GenerateMany`` on every connection to ``host:port``."""

    def __init__(self, service: Any, on_connection: Callable[[], None] | None = None) -> None:
        self.service = service
        self.on_connection = on_connection
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections = 0  # accepted so far
        self._streams: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens; returns the bound port. Raises ``OSError`` naming the flag if it cannot."""
        loop = asyncio.get_running_loop()
        try:
            self.server = await loop.create_server(self._connection, host, port)
        except OSError as exc:
            raise OSError(f"--frames-port: cannot bind {host}:{port} ({exc})") from exc
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Takes no new connections; streams still running get ``grace_s``, then are cut."""
        if self.server is not None:
            self.server.close()
        if self._streams:
            await asyncio.wait(list(self._streams), timeout=grace_s)
        for task in list(self._streams):
            task.cancel()
        if self._streams:
            await asyncio.gather(*self._streams, return_exceptions=True)

    def _connection(self) -> frames.FramedConnection[pb.CallFrames]:
        conn: frames.FramedConnection[pb.CallFrames] = frames.FramedConnection(
            pb.CallFrames.FromString
        )
        self.connections += 1
        if self.on_connection is not None:
            self.on_connection()
        task = asyncio.ensure_future(self._serve(conn))
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        return conn

    async def _serve(self, conn: frames.FramedConnection[pb.CallFrames]) -> None:
        await conn.connected
        assert conn.transport is not None
        host, port = conn.transport.get_extra_info("peername")[:2]
        context = _StreamContext(f"{'ipv6' if ':' in host else 'ipv4'}:{host}:{port}")

        async def incoming() -> AsyncIterator[pb.CallFrames]:
            while (batch := await conn.read()) is not frames.EOF:
                yield batch

        replies = self.service.GenerateMany(incoming(), context)
        try:
            # aclosing: however this ends, the stream's own clean-up aborts its calls.
            async with contextlib.aclosing(replies):
                async for batch in replies:
                    await conn.write(batch)
        except ConnectionError as exc:
            logger.debug("frames stream from %s ended: %r", context.peer(), exc)
        finally:
            if conn.transport is not None and not conn.transport.is_closing():
                conn.transport.close()
