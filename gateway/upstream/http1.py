"""A lean HTTP/1.1 client for one kind of call: a POST whose response is read as it streams.

The openai-http upstream sends every request to vLLM this way. aiohttp's client did
the same job for 0.18-0.24 ms more of the gateway's CPU a small chat (same-run A/Bs
on a 2-core host, docs/RESULTS.md "In front of vLLM workers"): its request and response
objects, header multidicts, cookie jar and tracing hooks cost more than the routing
decision. Here a request is one ``write`` of bytes built from a
prefix made once per URL, and the response is decoded in ``data_received`` (status
line, headers, chunked or sized body) into a buffer the reader takes whole.

What it supports is what an inference server's response needs: ``Content-Length``,
``Transfer-Encoding: chunked`` or a body to the connection's end; keep-alive with a
pool per host, whose idle connections go before the server's own keep-alive timeout
(uvicorn, vLLM's server, closes them after 5 s); TLS for ``https`` URLs. A request
whose reused connection turns out closed before any byte of the response came back is
sent once more on a new connection (the server closed it idle, so never read it).
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

# A connection idle this long is not reused: uvicorn closes its own after 5 s idle.
IDLE_S = 4.0
# Body bytes held unread before the socket stops being read (a slow client behind us).
_PAUSE_AT = 1 << 20
_MAX_HEAD = 64 * 1024
_SWEEP_EVERY = 1024  # releases between sweeps for hosts gone stale


class HttpProtocolError(ConnectionError):
    """The server's response is not HTTP/1.1 as this client reads it."""


class Target:
    """A URL, parsed once: where to connect and the request bytes that precede a body."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (self.tls, self.host, self.port)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        host = parts.netloc.rpartition("@")[2]
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self._head = ("\r\n".join(lines) + "\r\n").encode("latin-1")

    def request(self, body: bytes, request_id: str = "") -> bytes:
        """The request's bytes; ``request_id`` goes as ``X-Request-Id`` (vLLM takes it
        as its own id for the request, so its logs name the gateway's)."""
        rid = b""
        if request_id and request_id.isascii() and request_id.isprintable():
            rid = b"X-Request-Id: %b\r\n" % request_id.encode()
        return b"%b%bContent-Length: %d\r\n\r\n%b" % (self._head, rid, len(body), body)


class Connection(asyncio.Protocol):
    """One TCP connection, one request at a time; the response is decoded as it arrives."""

    def __init__(self, key: tuple[bool, str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._on_complete: Callable[[Connection], None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.got_bytes = False  # any byte of the current response
        self.complete = False  # the current response read to its end
        self.keep_alive = True
        self._head = b""
        self._raw = b""  # chunked framing not decoded yet
        self._body = bytearray()  # decoded body bytes not taken yet
        self._left = 0  # body bytes to come (sized) or of the current chunk (chunked)
        self._mode = ""  # "sized", "chunked", "eof" once the head is read
        self._chunk_end = False  # a chunk's data is read; its CRLF is next

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._mode == "eof" and exc is None:
            self.complete = True
            self.keep_alive = False
        elif not self.complete and self._error is None:
            self._error = exc or ConnectionResetError("the server closed the connection")
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self.complete:  # bytes past the response's end: the connection is not reused
            self.keep_alive = False
            return
        self.got_bytes = True
        try:
            if not self._mode:
                data = self._read_head(data)
                if not self._mode:
                    return
            if data:
                self._read_body(data)
        except HttpProtocolError as exc:
            self.fail(exc)
            return
        if self.complete and self._on_complete is not None:
            on_complete, self._on_complete = self._on_complete, None
            on_complete(self)
        elif len(self._body) > _PAUSE_AT and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    # decoding

    def _read_head(self, data: bytes) -> bytes:
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _MAX_HEAD:
                raise HttpProtocolError("response headers too long")
            return b""
        head, rest = self._head[:end], self._head[end + 4 :]
        lines = head.decode("latin-1").split("\r\n")
        version, _, status = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not status[:3].isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        code = int(status[:3])
        if 100 <= code < 200:  # an interim response (100 Continue): the real one follows
            self._head = b""
            return self._read_head(rest) if rest else b""
        self.status = code
        self.keep_alive = version == "HTTP/1.1"
        length = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == "content-length":
                length = int(value) if value.isdigit() else -1
            elif name == "transfer-encoding":
                chunked = value.endswith("chunked")
            elif name == "connection":
                self.keep_alive = "close" not in value and (
                    self.keep_alive or "keep-alive" in value
                )
        if code in (204, 304):  # never a body, whatever the headers say
            self._mode, self.complete = "sized", True
        elif chunked:
            self._mode = "chunked"
        elif length is not None:
            if length < 0:
                raise HttpProtocolError("bad Content-Length")
            self._mode, self._left = "sized", length
            self.complete = length == 0
        else:
            self._mode = "eof"
        self._head = b""
        return rest

    def _read_body(self, data: bytes) -> None:
        if self._mode == "sized":
            take = data[: self._left]
            self._body += take
            self._left -= len(take)
            self.complete = self._left == 0
            if len(data) > len(take):
                self.keep_alive = False  # bytes past the response: do not trust the rest
        elif self._mode == "eof":
            self._body += data
        else:
            self._read_chunks(data)

    def _read_chunks(self, data: bytes) -> None:
        raw = self._raw + data if self._raw else data
        pos = 0
        n = len(raw)
        while pos < n and not self.complete:
            if self._left:
                take = raw[pos : pos + self._left]
                self._body += take
                self._left -= len(take)
                pos += len(take)
                self._chunk_end = self._left == 0
                continue
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > 1024:
                    raise HttpProtocolError("a chunk size line too long")
                break
            line = raw[pos:eol]
            pos = eol + 2
            if self._chunk_end:  # the CRLF after a chunk's data
                if line:
                    raise HttpProtocolError("chunk data longer than its size")
                self._chunk_end = False
                continue
            if self._mode == "trailers":
                if not line:
                    self.complete = True
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise HttpProtocolError(f"bad chunk size {line[:40]!r}") from None
            if size == 0:
                self._mode = "trailers"  # trailer lines, then an empty line
            else:
                self._left = size
        self._raw = raw[pos:] if not self.complete else b""

    # the reader's side

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> int:
        """The response's status, once its headers are in."""
        while not self._mode:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.status

    async def read(self) -> bytes:
        """Every body byte that has arrived (waits for one); ``b""`` at the body's end.
        A read cancelled while it waits has taken nothing."""
        while not self._body:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        data = bytes(self._body)
        self._body.clear()
        if self.transport is not None and not self.complete:
            self.transport.resume_reading()
        return data

    async def whole_body(self, limit: int) -> bytes:
        """The body once read to its end (an error's, which is short), at most ``limit``
        bytes; a wait cancelled here takes nothing, as ``read``'s."""
        while not self.complete and self._error is None and len(self._body) < limit:
            if self.transport is not None:
                self.transport.resume_reading()  # paused past _PAUSE_AT: wanted here
            await self._wait()
        if self._error is not None and not self._body:
            raise self._error
        data = bytes(self._body[:limit])
        self._body.clear()
        return data

    def fail(self, exc: BaseException) -> None:
        """Ends the response with ``exc`` and closes the connection (a timeout's)."""
        if self._error is None and not self.complete:
            self._error = exc
        self.close()
        self._wake()

    def close(self) -> None:
        self.keep_alive = False
        self._on_complete = None
        if self.transport is not None:
            self.transport.close()  # the server sees its client go (vLLM aborts)

    def when_complete(self, then: Callable[[Connection], None]) -> None:
        """``then(self)`` once the response is read to its end (at once if it is)."""
        if self.complete:
            then(self)
        else:
            self._on_complete = then
            if self.transport is not None:
                self.transport.resume_reading()

    def begin(self, request: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.transport.write(request)

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and self._error is None
            and self.transport is not None
            and not self.transport.is_closing()
        )


class Pool:
    """Keep-alive connections per (scheme, host, port), the most recently used taken first."""

    def __init__(self, connect_timeout_s: float, idle_s: float = IDLE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self._idle: dict[tuple[bool, str, int], deque[Connection]] = {}
        self._all: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self._releases = 0
        # Read by the gateway's metrics at scrape time (plain ints: no cost a request).
        self.opened = 0  # connections opened
        self.reused = 0  # requests sent on a pooled connection
        self.resent = 0  # requests sent again: their pooled connection had been closed

    def _fresh(self, conn: Connection, now: float) -> bool:
        """Fit to carry a request at ``now``: open, kept alive, idle for less than ``idle_s``."""
        return conn.reusable and now - conn.idle_since < self.idle_s

    def take(self, key: tuple[bool, str, int]) -> Connection | None:
        """An idle connection to ``key`` that the server has not closed, if any."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if self._fresh(conn, now):
                self.reused += 1
                return conn
            conn.close()
        return None

    async def connect(self, target: Target) -> Connection:
        """A new connection; ``ConnectionError`` if none opens within the connect timeout."""
        if self._closed:
            raise ConnectionError("the HTTP pool is closed")
        loop = asyncio.get_running_loop()
        ctx = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(target.key),
                    target.host,
                    target.port,
                    ssl=ctx,
                    server_hostname=target.host if ctx else None,
                )
        except TimeoutError:
            raise ConnectionError(f"no connection within {self.connect_timeout_s:g}s") from None
        self._all.add(conn)
        self.opened += 1
        return conn

    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def release(self, conn: Connection) -> None:
        """Back to the pool if its response was read whole and the server keeps it open."""
        if self._closed or not conn.reusable:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._releases += 1
        if self._releases % _SWEEP_EVERY == 0:
            self._sweep(conn.idle_since)
        idle = self._idle.setdefault(conn.key, deque())
        # The oldest are at the left: drop the ones that went stale meanwhile.
        while idle and not self._fresh(idle[0], conn.idle_since):
            idle.popleft().close()
        idle.append(conn)

    def _sweep(self, now: float) -> None:
        """Drops the hosts whose idle connections all went stale: workers that left the
        fleet are never asked again, so nothing else would drop theirs."""
        for key, idle in list(self._idle.items()):
            if not any(self._fresh(c, now) for c in idle):
                for conn in idle:
                    conn.close()
                del self._idle[key]

    def release_when_complete(self, conn: Connection, within_s: float) -> None:
        """``release`` once the rest of its response is read, or close it after
        ``within_s``: the answer it carried is complete, the server's end of the
        response may come a moment later."""
        if conn.complete:
            self.release(conn)
            return
        timer = asyncio.get_running_loop().call_later(within_s, conn.close)

        def done(c: Connection) -> None:
            timer.cancel()
            self.release(c)

        conn.when_complete(done)

    def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
