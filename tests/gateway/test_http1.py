"""The lean HTTP/1.1 client: response decoding fed byte by byte, and a pool against
real sockets served by scripted asyncio servers (what each server writes is exact)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.upstream.base import Generation, UpstreamError
from gateway.upstream.http1 import Connection, HttpProtocolError, Pool, Target
from gateway.upstream.openai_http import OpenAIHTTPUpstream

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b"data: one\n\n", b"data: two, longer\n\n", b"data: [DONE]\n\n"]
CHUNKED = (
    HEAD + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS) + b"0\r\nx-trailer: 1\r\n\r\n"
)


def _fed(pieces: list[bytes]) -> tuple[Connection, bytes]:
    conn = Connection((False, "h", 1))
    body = b""
    for piece in pieces:
        conn.data_received(piece)
        body += bytes(conn._body)
        conn._body.clear()
    return conn, body


def test_a_chunked_response_decodes_however_it_is_split() -> None:
    for cut in range(1, len(CHUNKED)):
        conn, body = _fed([CHUNKED[:cut], CHUNKED[cut:]])
        assert body == b"".join(EVENTS), cut
        assert conn.complete and conn.status == 200 and conn.keep_alive
    conn, body = _fed([bytes([b]) for b in CHUNKED])  # a byte at a time
    assert body == b"".join(EVENTS) and conn.complete


def test_sized_interim_and_to_the_end_responses() -> None:
    conn, body = _fed([b"HTTP/1.1 400 Bad Request\r\nContent-Length: 4\r\n\r\nno", b"pe"])
    assert (conn.status, body, conn.complete, conn.keep_alive) == (400, b"nope", True, True)
    conn, body = _fed(
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
    )
    assert (conn.status, body, conn.complete) == (200, b"ok", True)
    # No length and not chunked: the body ends with the connection, which is not reused.
    conn, body = _fed([b"HTTP/1.0 200 OK\r\n\r\nsome", b" body"])
    assert body == b"some body" and not conn.complete
    conn.connection_lost(None)
    assert conn.complete and not conn.keep_alive
    conn, _ = _fed([b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"])
    assert conn.complete and not conn.keep_alive
    conn, body = _fed([b"HTTP/1.1 204 No Content\r\n\r\n"])
    assert (conn.status, body, conn.complete, conn.keep_alive) == (204, b"", True, True)
    conn, _ = _fed([CHUNKED, b"HTTP/1.1 200 OK\r\n"])  # bytes nobody asked for
    assert conn.complete and not conn.keep_alive


@pytest.mark.parametrize(
    "response",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
    ],
)
async def test_what_is_not_http_fails_the_response(response: bytes) -> None:
    conn = Connection((False, "h", 1))
    conn.data_received(response)
    with pytest.raises(HttpProtocolError):
        while await conn.read():  # what came before the fault is read first
            pass


def test_the_request_is_one_write_of_head_and_body() -> None:
    t = Target("http://10.0.0.7:8000/v1/completions", {"Content-Type": "application/json"})
    assert t.key == (False, "10.0.0.7", 8000)
    assert t.request(b'{"a":1}') == (
        b"POST /v1/completions HTTP/1.1\r\nHost: 10.0.0.7:8000\r\n"
        b"Content-Type: application/json\r\nContent-Length: 7\r\n\r\n"
        b'{"a":1}'
    )
    assert t.request(b"{}", "cmpl-7f").endswith(
        b"\r\nX-Request-Id: cmpl-7f\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert b"X-Request-Id" not in t.request(b"{}", "bad\r\nid")  # never a header injected
    assert Target("https://w.example/v1/completions", {}).key == (True, "w.example", 443)
    with pytest.raises(ValueError):
        Target("ftp://w/v1", {})


Script = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A TCP server whose connections run ``script``; counts connections and requests."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        self.requests += 1
        return await reader.readexactly(length)


Serve = Callable[[Script], Awaitable[tuple[Server, Target]]]


def keep_answering(response: bytes) -> Script:
    """A server script: every request on a connection gets ``response``."""

    async def script(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            await server.request(reader)
            writer.write(response)

    return script


def answer_once(response: bytes, after_s: float = 0.0) -> Script:
    """A server script: the first request gets ``response`` after ``after_s``; the
    connection then stays open, silent, until the client closes it."""

    async def script(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.request(reader)
        await asyncio.sleep(after_s)
        writer.write(response)
        await reader.read()

    return script


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> tuple[Server, Target]:
        handler = Server(script)
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return handler, Target(f"http://127.0.0.1:{port}/v1/completions", {})

    yield start
    for s in servers:
        s.close()


async def _round_trip(pool: Pool, target: Target) -> bytes:
    conn = pool.take(target.key) or await pool.connect(target)
    conn.begin(target.request(b"{}"))
    assert await conn.head() == 200
    body = b""
    while data := await conn.read():
        body += data
    pool.release(conn)
    return body


async def test_keep_alive_connections_are_reused_and_closed_ones_are_not(serve: Serve) -> None:
    server, target = await serve(keep_answering(CHUNKED))
    pool = Pool(1.0)
    for _ in range(3):
        assert await _round_trip(pool, target) == b"".join(EVENTS)
    assert (server.connections, server.requests) == (1, 3)
    assert (pool.opened, pool.reused, pool.idle_connections()) == (1, 2, 1)  # the metrics

    async def one_each(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")

    closing, target = await serve(one_each)
    for _ in range(2):
        assert await _round_trip(pool, target) == b"ok"
    assert closing.connections == 2
    pool.close()


async def test_idle_connections_expire_before_the_servers_keep_alive(serve: Serve) -> None:
    server, target = await serve(keep_answering(CHUNKED))
    pool = Pool(1.0, idle_s=0.1)
    await _round_trip(pool, target)
    await asyncio.sleep(0.2)
    assert pool.take(target.key) is None  # idle too long: closed, not handed out
    await _round_trip(pool, target)
    assert server.connections == 2
    # A host nobody asks again (a worker that left) is dropped by a later sweep.
    await asyncio.sleep(0.2)
    pool._sweep(time.monotonic())
    assert target.key not in pool._idle
    pool.close()


async def test_unread_body_pauses_the_socket_and_reading_resumes_it(serve: Serve) -> None:
    big = b"x" * (3 << 20)

    async def large(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big))
        writer.write(big)
        await writer.drain()

    _, target = await serve(large)
    pool = Pool(1.0)
    conn = await pool.connect(target)
    conn.begin(target.request(b"{}"))
    await conn.head()
    await asyncio.sleep(0.3)  # the server writes all it can; the client stops at its bound
    assert len(conn._body) < len(big)
    got = 0
    while data := await conn.read():
        got += len(data)
    assert got == len(big) and conn.complete
    pool.close()


async def test_a_refused_or_silent_connect_is_a_connection_error(serve: Serve) -> None:
    pool = Pool(0.2)
    with pytest.raises(ConnectionError):
        await pool.connect(Target("http://127.0.0.1:9/v1/completions", {}))  # discard port
    # 192.0.2.0/24 is TEST-NET-1: unroutable, so the connect times out (or fails at once).
    with pytest.raises(OSError):
        await pool.connect(Target("http://192.0.2.1:80/v1/completions", {}))


# Through the openai-http upstream: what the pool's users rely on.

ANSWER = b"".join(
    b"data: %b\n\n" % e
    for e in (
        b'{"choices":[{"index":0,"token_ids":[5],"finish_reason":null}]}',
        b'{"choices":[{"index":0,"token_ids":[6],"finish_reason":"stop"}]}',
        b'{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":16}}}',
        b"[DONE]",
    )
)
ANSWERED = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(ANSWER), ANSWER)
GEN = Generation("r", [1, 2, 3], 2, 0.0, 1.0, 0, None, False, (), "")


async def _answer(up: OpenAIHTTPUpstream, target: Target, timeout_s: float = 5.0) -> list[int]:
    call = up.start("w", f"{target.host}:{target.port}", GEN, timeout_s)
    ids: list[int] = []
    while (chunk := await call.read()) is not None:
        ids += chunk.token_ids
        if chunk.finished:
            assert chunk.cached_tokens == 16
    return ids


async def test_a_request_on_a_connection_closed_while_idle_goes_again_on_a_new_one(
    serve: Serve,
) -> None:
    # The server closes a kept-alive connection just as the next request is sent on it
    # (uvicorn's keep-alive timeout): that request was never read, so it is sent again.
    async def once_then_close(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.request(reader)
        writer.write(ANSWERED)
        await reader.readuntil(b"\r\n\r\n")  # the next request's head, then the close

    server, target = await serve(once_then_close)
    up = OpenAIHTTPUpstream()
    assert await _answer(up, target) == [5, 6]
    assert await _answer(up, target) == [5, 6]
    assert (server.connections, server.requests) == (2, 2)
    assert (up.pool.opened, up.pool.reused, up.pool.resent) == (2, 1, 1)
    await up.close()


async def test_a_slow_head_is_waited_for_by_polls_and_the_request_sent_once(serve: Serve) -> None:
    # The dispatcher polls for the first token every 0.25 s: a poll that ends while
    # the worker has not even answered with headers must not send the request again.
    server, target = await serve(answer_once(ANSWERED, after_s=0.3))
    up = OpenAIHTTPUpstream()
    call = up.start("w", f"127.0.0.1:{target.port}", GEN, 5.0)
    polls = 0
    while True:
        try:
            chunk = await call.read_within(0.05)
            break
        except TimeoutError:
            polls += 1
    assert polls >= 2 and chunk is not None and chunk.finished
    assert (server.connections, server.requests) == (1, 1)
    await up.close()


async def test_a_worker_that_never_answers_times_out_as_a_504(serve: Serve) -> None:
    # One event of a chunked stream, and nothing more until the client goes.
    _, target = await serve(answer_once(HEAD + b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0])))
    up = OpenAIHTTPUpstream()
    with pytest.raises(UpstreamError) as info:
        await _answer(up, target, timeout_s=0.3)
    assert info.value.api_error.status == 504 and not info.value.retryable
    await up.close()


def test_the_upstream_runs_on_uvloop_as_the_gateway_does() -> None:
    # uvloop's transports are not asyncio.Transport subclasses.
    import uvloop

    async def main() -> list[int]:
        server = Server(keep_answering(ANSWERED))
        listening = await asyncio.start_server(server, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        target = Target(f"http://127.0.0.1:{port}/v1/completions", {})
        up = OpenAIHTTPUpstream()
        try:
            return await _answer(up, target) + await _answer(up, target)
        finally:
            await up.close()
            listening.close()
            assert server.connections == 1

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == [5, 6, 5, 6]
