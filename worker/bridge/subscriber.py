"""The ZMQ side of the bridge: live KV-event frames, replays, and connection state.

A SUB socket connects to the engine's PUB endpoint (vLLM binds ``tcp://*:N``).
A socket monitor reports when the TCP connection drops and comes back, which
is how the bridge notices an engine restart even before any new event. A
replay asks the engine's ROUTER endpoint for every buffered batch from a seq
on, over a fresh DEALER, and stops at the end marker or a timeout.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from worker.bridge.engine_events import EngineBatch, parse_published, parse_replayed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replay:
    """What a replay returned: batches in seq order, and whether the end marker came."""

    batches: list[EngineBatch]
    complete: bool

    def covers(self, start: int) -> bool:
        """True when the replay holds every batch from ``start`` on (no hole at the front)."""
        return self.complete and (not self.batches or self.batches[0].seq == start)


class EventSubscriber:
    """Live frames from one engine, plus replays from its replay endpoint."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        engine: str = "vllm",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.engine = engine
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.connected = False
        self.disconnects = 0  # TCP disconnects seen since open (tests, logs)
        self.bad_frames = 0

    def open(self) -> None:
        """Connects the SUB socket (ZMQ reconnects on its own from here on)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop a frame on our side
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        self._sub = sub

    def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        self._ctx.term()

    async def connection_events(self) -> list[str]:
        """Drains the monitor: ``"connected"`` / ``"disconnected"``, in order."""
        out: list[str] = []
        monitor = self._monitor
        while monitor is not None and await monitor.poll(0):
            msg = await recv_monitor_message(monitor)  # type: ignore[misc]
            if msg["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
                out.append("connected")
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.disconnects += 1
                out.append("disconnected")
        return out

    async def recv(self, timeout_s: float) -> EngineBatch | None:
        """The next live batch, or None if none came within ``timeout_s``."""
        assert self._sub is not None, "open() first"
        while await self._sub.poll(int(timeout_s * 1000)):
            frames = await self._sub.recv_multipart()
            try:
                return parse_published(frames, self.engine)
            except ValueError as exc:
                self.bad_frames += 1
                logger.warning("dropping an undecodable KV event frame: %s", exc)
            timeout_s = 0.0
        return None

    async def replay(self, start: int) -> Replay | None:
        """Every buffered batch with seq >= ``start``; None without a replay endpoint."""
        if not self.replay_endpoint:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        batches: list[EngineBatch] = []
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", max(0, start).to_bytes(8, "big")])
            while await dealer.poll(int(self.replay_timeout_s * 1000)):
                frames = await dealer.recv_multipart()
                try:
                    batch = parse_replayed(frames, self.engine)
                except ValueError as exc:
                    logger.warning("replay from %d: undecodable frame (%s)", start, exc)
                    return Replay(batches, complete=False)
                if batch is None:
                    return Replay(batches, complete=True)
                batches.append(batch)
            logger.warning(
                "replay from %d timed out after %d batches (%s)",
                start,
                len(batches),
                self.replay_endpoint,
            )
            return Replay(batches, complete=False)
        finally:
            dealer.close(linger=0)
