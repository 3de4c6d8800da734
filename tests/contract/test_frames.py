"""``contract.frames``: length-prefixed protobuf messages on real loopback TCP connections."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from contract import frames
from contract import worker_pb2 as pb

pytestmark = pytest.mark.timeout(20)


def _frames(*ids: int) -> pb.CallFrames:
    return pb.CallFrames(
        frames=[
            pb.CallFrame(call_id=i, request=pb.GenerateRequest(request_id=f"r{i}")) for i in ids
        ]
    )


class _Peer:
    """A server whose connections are ``FramedConnection``s of ``CallFrames``."""

    async def start(self) -> _Peer:
        self.accepted: asyncio.Queue[frames.FramedConnection[pb.CallFrames]] = asyncio.Queue()

        def factory() -> frames.FramedConnection[pb.CallFrames]:
            conn: frames.FramedConnection[pb.CallFrames] = frames.FramedConnection(
                pb.CallFrames.FromString
            )
            self.accepted.put_nowait(conn)
            return conn

        self.server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def raw_client(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def close(self) -> None:
        self.server.close()


async def test_messages_cut_anywhere_arrive_whole_and_in_order() -> None:
    peer = await _Peer().start()
    _, writer = await peer.raw_client()
    conn = await peer.accepted.get()
    wire = b"".join(frames.encode(_frames(i, i + 1)) for i in range(0, 200, 2))
    # A byte at a time, then odd-sized pieces: the reader must reassemble either way.
    for i in range(0, 64):
        writer.write(wire[i : i + 1])
        await writer.drain()
    rest = wire[64:]
    for i in range(0, len(rest), 37):
        writer.write(rest[i : i + 37])
    await writer.drain()
    writer.write_eof()
    got = []
    while (msg := await conn.read()) is not frames.EOF:
        got.extend(f.call_id for f in msg.frames)
    assert got == list(range(200))
    writer.close()
    await peer.close()


async def test_a_length_over_the_limit_fails_the_connection_instead_of_buffering() -> None:
    peer = await _Peer().start()
    _, writer = await peer.raw_client()
    conn = await peer.accepted.get()
    writer.write(struct.pack(">I", frames.MAX_MESSAGE + 1) + b"x" * 10)
    await writer.drain()
    with pytest.raises(frames.FrameError, match="over the"):
        await conn.read()
    writer.close()
    await peer.close()


async def test_bytes_that_are_not_the_message_fail_the_connection() -> None:
    peer = await _Peer().start()
    reader, writer = await peer.raw_client()
    conn = await peer.accepted.get()
    writer.write(frames.encode(_frames(1)) + struct.pack(">I", 3) + b"\xff\xff\xff")
    await writer.drain()
    first = await conn.read()
    assert [f.call_id for f in first.frames] == [1]
    with pytest.raises(frames.FrameError, match="could not be parsed"):
        await conn.read()
    assert await reader.read() == b""  # and the connection was dropped
    writer.close()
    await peer.close()


async def test_a_half_close_is_a_clean_end_and_replies_still_go_back() -> None:
    peer = await _Peer().start()
    reader, writer = await peer.raw_client()
    conn = await peer.accepted.get()
    writer.write(frames.encode(_frames(5)))
    writer.write_eof()
    assert [f.call_id for f in (await conn.read()).frames] == [5]
    assert await conn.read() is frames.EOF
    # The peer only stopped sending: this side can still answer it.
    await conn.write(pb.ReplyFrames(frames=[pb.ReplyFrame(call_id=5)]))
    size = struct.unpack(">I", await reader.readexactly(4))[0]
    reply = pb.ReplyFrames.FromString(await reader.readexactly(size))
    assert reply.frames[0].call_id == 5
    writer.close()
    await peer.close()


async def test_a_reset_connection_is_an_error_not_an_end() -> None:
    peer = await _Peer().start()
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(
        lambda: frames.FramedConnection(pb.ReplyFrames.FromString), "127.0.0.1", peer.port
    )
    server_side = await peer.accepted.get()
    await client.write(_frames(1))
    assert [f.call_id for f in (await server_side.read()).frames] == [1]
    assert server_side.transport is not None
    sock = server_side.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    server_side.transport.abort()  # with a zero linger: a reset, not a FIN
    with pytest.raises(ConnectionError):
        await client.read()
    with pytest.raises(ConnectionError):
        await client.write(_frames(2))
    await peer.close()


async def test_a_reader_that_falls_behind_stops_the_socket_being_read() -> None:
    peer = await _Peer().start()
    _, writer = await peer.raw_client()
    conn = await peer.accepted.get()
    one = frames.encode(_frames(1))
    writer.write(one * (frames._READ_AHEAD * 2))
    await asyncio.sleep(0.2)
    assert conn._paused_reading  # TCP pushes back on the sender from here
    n = 0
    while n < frames._READ_AHEAD * 2:
        await conn.read()
        n += 1
    assert not conn._paused_reading
    writer.close()
    await peer.close()
