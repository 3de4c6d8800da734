"""What a gateway's gRPC call costs it, by call shape: the evidence for the next transport.

``bench_overhead`` puts ~40 % of the gateway's CPU for a small chat in
grpc.aio. This measures grpc.aio alone, with the real ``GenerateRequest`` and
``GenerateResponse`` messages of such a chat (209 prompt token ids, 8 tokens
back), against an instant server in another process, for each way the
gateway could carry a request:

- ``unary_stream``: today's ``Generate`` — one call per request, the first
  token in one message and the rest with the usage in a second;
- ``unary_stream_1``: the same call with one message back;
- ``unary``: one call, one message back (what a non-streaming request needs);
- ``bidi_mux``: one long-lived bidirectional call per worker carrying every
  request, the request id in each message, two messages back per request —
  the first token still goes at once;
- ``frames``: the same long-lived stream of ``CallFrames`` / ``ReplyFrames``
  without gRPC: length-prefixed messages on one TCP connection
  (``contract.frames``, a worker's ``--frames-port``).

Each mode runs a closed loop at ``--concurrency`` on a uvloop, in its own
client process (so the modes do not share a grpc channel or its threads), for
``--requests`` requests; modes alternate over ``--rounds`` rounds and every
figure is the median over rounds. CPU per request is the client process's own
user + system time (grpc.aio's poller thread included) divided by requests.

Prints one JSON object: ``{"modes": {MODE: {"cpu_ms_per_request",
"requests_per_s"}}, "cpu_vs_unary_stream": {MODE: ratio}, "load_average"}``.

    python -m loadtest.bench_grpc_shapes            # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from contract import frames
from contract import worker_pb2 as pb
from loadtest.fleet import free_port, sigterm_as_ctrl_c

MODES = ("unary_stream", "unary_stream_1", "unary", "bidi_mux", "frames")
SERVICE = "/kvroute.bench.Shapes/"
PROMPT_TOKENS = 209
NEW_TOKENS = 8


def _request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1000, 1000 + PROMPT_TOKENS)),
        sampling=pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9),
        cache_salt="bench",
    )


def _first(request_id: str) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(token_ids=[42], worker_id=request_id)
    msg.usage.prompt_tokens = PROMPT_TOKENS
    return msg


def _last(request_id: str, tokens: int) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        token_ids=[42] * tokens, finished=True, finish_reason="length", worker_id=request_id
    )
    msg.usage.prompt_tokens = PROMPT_TOKENS
    msg.usage.completion_tokens = NEW_TOKENS
    msg.ttft_s = 0.001
    return msg


# -- the instant server ------------------------------------------------------------


async def _serve_frames(port: int) -> None:
    """The ``frames`` mode's server: two ``ReplyFrames`` back per request frame."""

    async def answer(conn: frames.FramedConnection[pb.CallFrames]) -> None:
        while (batch := await conn.read()) is not frames.EOF:
            for frame in batch.frames:
                rid = frame.request.request_id
                first = pb.ReplyFrame(call_id=frame.call_id, response=_first(rid))
                last = pb.ReplyFrame(call_id=frame.call_id, response=_last(rid, NEW_TOKENS - 1))
                await conn.write(pb.ReplyFrames(frames=[first]))
                await conn.write(pb.ReplyFrames(frames=[last]))

    def connection() -> frames.FramedConnection[pb.CallFrames]:
        conn = frames.FramedConnection(pb.CallFrames.FromString)
        tasks.add(asyncio.ensure_future(answer(conn)))
        return conn

    tasks: set[asyncio.Future[None]] = set()
    await asyncio.get_running_loop().create_server(connection, "127.0.0.1", port)


async def _serve(port: int) -> None:
    async def two(req: pb.GenerateRequest, _ctx: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield _first(req.request_id)
        yield _last(req.request_id, NEW_TOKENS - 1)

    async def one(req: pb.GenerateRequest, _ctx: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield _last(req.request_id, NEW_TOKENS)

    async def unary(req: pb.GenerateRequest, _ctx: Any) -> pb.GenerateResponse:
        return _last(req.request_id, NEW_TOKENS)

    async def mux(
        requests: AsyncIterator[pb.GenerateRequest], _ctx: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        # The request id comes back in worker_id: enough for the client to dispatch.
        async for req in requests:
            yield _first(req.request_id)
            yield _last(req.request_id, NEW_TOKENS - 1)

    ser, de = pb.GenerateResponse.SerializeToString, pb.GenerateRequest.FromString
    handlers = {
        "UnaryStream": grpc.unary_stream_rpc_method_handler(two, de, ser),
        "UnaryStream1": grpc.unary_stream_rpc_method_handler(one, de, ser),
        "Unary": grpc.unary_unary_rpc_method_handler(unary, de, ser),
        "BidiMux": grpc.stream_stream_rpc_method_handler(mux, de, ser),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.strip("/"), handlers),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await _serve_frames(port + 1)
    print("ready", flush=True)
    await server.wait_for_termination()


# -- one client run ------------------------------------------------------------------


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _client(port: int, mode: str, requests: int, concurrency: int) -> dict[str, float]:
    ser, de = pb.GenerateRequest.SerializeToString, pb.GenerateResponse.FromString
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    ids = itertools.count()
    if mode in ("unary_stream", "unary_stream_1"):
        name = "UnaryStream" if mode == "unary_stream" else "UnaryStream1"
        stream_call = channel.unary_stream(SERVICE + name, ser, de)

        async def one() -> None:
            call = stream_call(_request(str(next(ids))), timeout=30)
            while (await call.read()) is not grpc.aio.EOF:
                pass

    elif mode == "unary":
        unary_call = channel.unary_unary(SERVICE + "Unary", ser, de)

        async def one() -> None:
            await unary_call(_request(str(next(ids))), timeout=30)

    elif mode == "frames":
        event_loop = asyncio.get_running_loop()
        _, conn = await event_loop.create_connection(
            lambda: frames.FramedConnection(pb.ReplyFrames.FromString), "127.0.0.1", port + 1
        )
        calls: dict[int, asyncio.Future[None]] = {}

        async def take() -> None:
            while (batch := await conn.read()) is not frames.EOF:
                for reply in batch.frames:
                    if reply.response.finished:
                        calls.pop(reply.call_id).set_result(None)

        reader = asyncio.ensure_future(take())

        async def one() -> None:
            call_id = next(ids)
            done = calls[call_id] = event_loop.create_future()
            request = pb.CallFrame(call_id=call_id, request=_request(str(call_id)))
            await conn.write(pb.CallFrames(frames=[request]))
            await done

    else:
        outgoing: asyncio.Queue[pb.GenerateRequest] = asyncio.Queue()
        waiting: dict[str, asyncio.Future[None]] = {}

        async def send() -> AsyncIterator[pb.GenerateRequest]:
            while True:
                yield await outgoing.get()

        mux = channel.stream_stream(SERVICE + "BidiMux", ser, de)(send())

        async def dispatch() -> None:
            async for msg in mux:
                if msg.finished:
                    waiting.pop(msg.worker_id).set_result(None)

        reader = asyncio.ensure_future(dispatch())

        async def one() -> None:
            request_id = str(next(ids))
            done = waiting[request_id] = asyncio.get_running_loop().create_future()
            outgoing.put_nowait(_request(request_id))
            await done

    for _ in range(200):  # warm up: channel connected, code paths hot
        await one()

    async def loop(n: int) -> None:
        for _ in range(n):
            await one()

    per_task = max(1, requests // concurrency)
    cpu0, t0 = _cpu_s(), time.perf_counter()
    await asyncio.gather(*(loop(per_task) for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    if mode in ("bidi_mux", "frames"):
        reader.cancel()
    await channel.close(grace=None)
    done_requests = per_task * concurrency
    return {
        "cpu_ms_per_request": round(cpu / done_requests * 1e3, 4),
        "requests_per_s": round(done_requests / elapsed, 1),
    }


# -- driver --------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run_client(port: int, mode: str, requests: int, concurrency: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_grpc_shapes", "--client", mode,
         "--port", str(port), "--requests", str(requests), "--concurrency", str(concurrency)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def run(rounds: int, requests: int, concurrency: int) -> dict[str, Any]:
    port = free_port()
    while not _port_free(port + 1):  # the frames server listens on the next port
        port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "loadtest.bench_grpc_shapes", "--serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the instant gRPC server did not start")
        load = [round(os.getloadavg()[0], 2)]
        rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for r in range(rounds):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                rows[mode].append(_run_client(port, mode, requests, concurrency))
            load.append(round(os.getloadavg()[0], 2))
    finally:
        server.terminate()
        server.wait(timeout=10)
    modes = {
        m: {k: round(statistics.median(row[k] for row in rs), 4) for k in rs[0]}
        for m, rs in rows.items()
    }
    base = modes["unary_stream"]["cpu_ms_per_request"]
    return {
        "modes": modes,
        "cpu_vs_unary_stream": {
            m: round(v["cpu_ms_per_request"] / base, 3) for m, v in modes.items()
        },
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "concurrency": concurrency,
        "requests_per_round": requests,
        "rounds": rounds,
        "load_average": load,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6400)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.port))
        return 0
    if args.client:
        import uvloop

        result = uvloop.run(_client(args.port, args.client, args.requests, args.concurrency))
        print(json.dumps(result))
        return 0
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1:
        parser.error("--rounds, --requests and --concurrency must be >= 1")
    with sigterm_as_ctrl_c():  # the rounds start a server and client processes
        result = run(args.rounds, args.requests, args.concurrency)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
