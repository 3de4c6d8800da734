"""One block index for every process of a gateway (``kvroute gateway --processes N``).

A gateway's first process (the *owner*) mirrors Redis into its ``BlockIndex``
as a single-process gateway does; the others (*fronts*) parse, tokenize, hash
and relay on their own cores and keep no block index: they ask the owner over a
unix socket. So a pod's index memory is one index, whatever the process count.

What crosses the socket, framed as ``HEADER`` (body length, kind, call id) and a body:

- ``L`` a prompt's block chain (packed little-endian u64) -> ``l`` each holder's
  leading blocks, ``worker n`` lines: the routing look-up, one per distinct chain;
- ``S`` / ``W`` speculate / withdraw a routed chain on a worker (no answer): a
  front's own next look-up, sent after on the same socket, sees it;
- ``B`` -> ``b`` every worker's block count (JSON), which the router's load
  model reads; fronts refresh it every ``COUNTS_S``;
- ``H`` (no answer) a front listens on the port: the owner's ``/readyz`` waits for
  every front, so no client connects to a pod whose fronts are still starting
  (its connections would all stay on the owner);
- ``R`` -> ``r`` the pod's metrics: the owner asks every front for its own
  (``M`` -> ``m``) and merges them with its own (``gateway.observe.metrics_merge``),
  so a scrape that lands on any process sees the whole pod.

In-flight load, sessions and the prefix demand are shared the way separate
gateway replicas share them (``gateway.routing.replicas``), so a front needs
nothing else from the owner. Look-ups answer on the owner's loop between its
other work: about 20 us each. A front that loses the owner stops: without the
index it would route blind, and the owner restarts fronts that exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import struct
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from gateway.observe.metrics_merge import merge_metrics
from gateway.routing.index import BlockIndex

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<IBI")  # body length, kind, call id (0: no answer wanted)
_SPEC = struct.Struct("<dH")  # speculate: seconds to hold, worker id length
_WID = struct.Struct("<H")  # withdraw: worker id length
COUNTS_S = 0.5  # how often a front refreshes the workers' block counts
ASK_TIMEOUT_S = 5.0  # a metrics question to a front (look-ups wait without a timer)

Render = Callable[[], Awaitable[bytes]]


def pod_id(index_socket: str) -> str:
    """A short id that every process of one gateway derives from its index socket's
    path (the owner makes that path unique: a fresh temporary directory)."""
    return hashlib.blake2b(index_socket.encode(), digest_size=4).hexdigest()


def _chain_bytes(chain: Sequence[int]) -> bytes:
    return array("Q", chain).tobytes()


def _chain(body: bytes | memoryview) -> array[int]:
    chain = array("Q")
    chain.frombytes(body)
    return chain


class _Link(asyncio.Protocol):
    """Both ends of the socket: frames in and out, questions matched to answers by id."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[bytes]] = {}
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the other end of the index socket went away"))
        self._waiting.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, kind: bytes, call: int, body: bytes = b"") -> None:
        if self.transport is not None:
            self.transport.write(HEADER.pack(len(body), kind[0], call) + body)

    def ask(self, kind: bytes, body: bytes = b"") -> asyncio.Future[bytes]:
        """The answer to one question (fails with ``ConnectionError`` if the link drops)."""
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if self.transport is None:
            fut.set_exception(ConnectionError("not connected to the gateway's index owner"))
            return fut
        self._next_id = (self._next_id % 0xFFFFFFFF) + 1
        self._waiting[self._next_id] = fut
        self.send(kind, self._next_id, body)
        return fut

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= HEADER.size:
            size, kind, call = HEADER.unpack_from(buf, start)
            end = start + HEADER.size + size
            if len(buf) < end:
                break
            body = bytes(buf[start + HEADER.size : end])
            start = end
            if kind in _ANSWERS:
                fut = self._waiting.pop(call, None)
                if fut is not None and not fut.done():
                    fut.set_result(body)
            else:
                self.received(kind, call, body)
        del buf[:start]

    def received(self, kind: int, call: int, body: bytes) -> None:
        raise NotImplementedError

    def answer_later(self, kind: bytes, call: int, work: Awaitable[bytes]) -> None:
        """Answers ``call`` with ``work``'s result once it is done (nothing if it fails:
        the asker's timeout covers it)."""

        def send(task: asyncio.Future[bytes]) -> None:
            if not task.cancelled() and task.exception() is None:
                self.send(kind, call, task.result())

        asyncio.ensure_future(work).add_done_callback(send)


_ANSWERS = frozenset(b"lbrm")


class _OwnerSide(_Link):
    """The owner's end of one front's socket: answers from the owner's index."""

    def __init__(self, server: IndexServer) -> None:
        super().__init__()
        self.server = server
        self.listening = False  # the front said it listens on the port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.fronts.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.fronts.discard(self)

    def received(self, kind: int, call: int, body: bytes) -> None:
        index = self.server.index
        if kind == 76:  # L
            found = index.longest_prefix(_chain(body), time.monotonic())
            self.send(b"l", call, "\n".join(f"{w} {n}" for w, n in found.items()).encode())
        elif kind == 83:  # S
            ttl, n = _SPEC.unpack_from(body)
            at = _SPEC.size + n
            wid = body[_SPEC.size : at].decode()
            index.speculate(wid, _chain(body[at:]), time.monotonic(), ttl)
        elif kind == 87:  # W
            (n,) = _WID.unpack_from(body)
            wid = body[_WID.size : _WID.size + n].decode()
            index.withdraw(wid, _chain(body[_WID.size + n :]))
        elif kind == 66:  # B
            counts = {w: index.block_count(w) for w in index.workers()}
            self.send(b"b", call, json.dumps(counts).encode())
        elif kind == 72:  # H
            self.listening = True
        elif kind == 82:  # R
            self.answer_later(b"r", call, self.server.pod_metrics())
        else:
            logger.warning("index socket: unknown frame kind %r from a front", chr(kind))


class IndexServer:
    """The owner's socket: serves its index to the fronts and merges the pod's metrics."""

    def __init__(self, path: str, index: BlockIndex) -> None:
        self.path = path
        self.index = index
        self.fronts: set[_OwnerSide] = set()
        self._server: asyncio.AbstractServer | None = None
        self._started = False

    async def start(self, render: Render) -> None:
        """Listens; ``render`` gives this process's own metrics."""
        self.render = render
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _OwnerSide(self), self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for front in list(self.fronts):
                if front.transport is not None:
                    front.transport.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def fronts_listening(self) -> int:
        return sum(front.listening for front in self.fronts)

    def started(self, fronts: int) -> bool:
        """Whether all ``fronts`` have listened at least once: readiness waits for that
        at start-up only (a front that restarts later leaves the others serving)."""
        if not self._started and self.fronts_listening() >= fronts:
            self._started = True
        return self._started

    async def pod_metrics(self) -> bytes:
        """This process's metrics merged with every front's (a front that does not
        answer within ``ASK_TIMEOUT_S`` is left out; its counters come back with it)."""
        own = await self.render()
        asks = [front.ask(b"M") for front in self.fronts]
        texts = [own]
        if asks:
            done, late = await asyncio.wait(asks, timeout=ASK_TIMEOUT_S)
            for fut in late:
                fut.cancel()
            texts += [f.result() for f in done if f.exception() is None]
        return merge_metrics(texts)


class _FrontSide(_Link):
    """A front's end: answers the owner's ``M`` with this process's metrics."""

    def __init__(self, render: Render) -> None:
        super().__init__()
        self.render = render

    def received(self, kind: int, call: int, body: bytes) -> None:
        if kind == 77:  # M
            self.answer_later(b"m", call, self.render())


class RemoteIndex:
    """A front's view of the owner's index: the calls ``Dispatcher`` makes on an index."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.link: _FrontSide | None = None
        self.counts: dict[str, int] = {}

    async def connect(self, render: Render, timeout_s: float = 30.0) -> None:
        """Connects to the owner, retrying while it starts; ``render`` gives this
        process's own metrics."""
        self.render = render
        loop = asyncio.get_running_loop()
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                _, link = await loop.create_unix_connection(lambda: _FrontSide(render), self.path)
                break
            except OSError:
                if time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(0.05)
        self.link = link
        await self.refresh_counts()

    @property
    def closed(self) -> asyncio.Future[None]:
        assert self.link is not None
        return self.link.closed

    async def longest_prefix(self, chain: Sequence[int]) -> dict[str, int]:
        """Per worker, the leading blocks of ``chain`` the owner's index says it holds
        (empty while the owner is unreachable: the request is routed on load alone)."""
        if self.link is None:
            return {}
        try:
            raw = await self.link.ask(b"L", _chain_bytes(chain))
        except ConnectionError:
            return {}
        found: dict[str, int] = {}
        for line in raw.decode().splitlines():
            wid, _, n = line.rpartition(" ")
            found[wid] = int(n)
        return found

    def speculate(self, worker_id: str, chain: Sequence[int], now: float, ttl: float) -> None:
        if self.link is not None and chain:
            wid = worker_id.encode()
            self.link.send(b"S", 0, _SPEC.pack(ttl, len(wid)) + wid + _chain_bytes(chain))

    def withdraw(self, worker_id: str, chain: Sequence[int]) -> None:
        if self.link is not None and chain:
            wid = worker_id.encode()
            self.link.send(b"W", 0, _WID.pack(len(wid)) + wid + _chain_bytes(chain))

    def real_depth(self, worker_id: str, chain: Sequence[int]) -> int:
        """0: a front claims the whole chain (asking the owner would cost a round trip
        per request; the owner's index skips nothing then, as before)."""
        return 0

    def block_count(self, worker_id: str) -> int:
        return self.counts.get(worker_id, 0)

    def block_counts(self, worker_ids: list[str]) -> list[int]:
        """``block_count`` of each of ``worker_ids``, in order."""
        get = self.counts.get
        return [get(w, 0) for w in worker_ids]

    def listening(self) -> None:
        """Tells the owner this front accepts connections on the port."""
        if self.link is not None:
            self.link.send(b"H", 0)

    async def refresh_counts(self) -> None:
        if self.link is None:
            return
        with contextlib.suppress(ConnectionError):
            self.counts = json.loads(await self.link.ask(b"B"))

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(COUNTS_S)
            await self.refresh_counts()

    async def pod_metrics(self) -> bytes:
        """The whole pod's metrics, merged by the owner."""
        if self.link is None:
            return await self.render()
        try:
            return await asyncio.wait_for(self.link.ask(b"R"), 2 * ASK_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            return await self.render()  # this process's own, rather than nothing


def front_tasks(remote: RemoteIndex, stop: Callable[[], None]) -> list[asyncio.Task[Any]]:
    """A front's background work: keep the block counts fresh; stop when the owner goes."""

    async def watch_owner() -> None:
        await remote.closed
        logger.error("the gateway's index owner went away; this front process stops")
        stop()

    return [asyncio.create_task(remote.refresh_forever()), asyncio.create_task(watch_owner())]
