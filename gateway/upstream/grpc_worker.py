"""gRPC clients for the workers: one ``grpc.aio`` channel per worker, reused.

A channel is created on first use and replaced when the worker's address
changes; it is closed when the worker leaves the registry.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from contract import worker_pb2_grpc

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Fail fast when a worker is gone instead of waiting for reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WorkerClients:
    """Worker id -> a live stub on a channel to that worker's address."""

    def __init__(self, tls_ca: bytes | None = None) -> None:
        # With a CA bundle every worker channel is TLS, verified against it.
        self._credentials = grpc.ssl_channel_credentials(tls_ca) if tls_ca else None
        self._channels: dict[str, tuple[str, grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def stub(self, worker_id: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """The stub for ``worker_id`` at ``address`` (a new channel if the address moved)."""
        entry = self._channels.get(worker_id)
        if entry is not None and entry[0] == address:
            return entry[2]
        if entry is not None:
            self._close_later(entry[1])
        if self._credentials is not None:
            channel = grpc.aio.secure_channel(address, self._credentials, options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._channels[worker_id] = (address, channel, stub)
        return stub

    def forget(self, worker_id: str) -> None:
        """Closes the channel of a worker that went away (in the background)."""
        entry = self._channels.pop(worker_id, None)
        if entry is not None:
            self._close_later(entry[1])

    async def close(self) -> None:
        """Closes every channel."""
        channels = [c for _, c, _ in self._channels.values()]
        self._channels.clear()
        for channel in channels:
            await channel.close(grace=None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._channels)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=1.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
