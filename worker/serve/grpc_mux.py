"""``GenerateMany``: many ``Generate`` calls carried on one long-lived gRPC stream.

A gateway opens one such stream per worker and sends each request as a frame
with its own call id; per-call setup (an HTTP/2 stream, its headers, deadline
and status) was about half of what a small request cost the gateway
(``loadtest.bench_grpc_shapes``). The worker runs every framed call through
the servicer's own ``Generate`` method with a stand-in context, so a framed
call answers, fails and aborts exactly as a ``Generate`` call does: the
engine sees no difference. ``context.abort`` becomes a status frame, a cancel
frame cancels the call's task (whose ``finally`` aborts the request), and the
gateway closing its side ends the stream once every call on it has ended.
Replies ready at the same time leave in one message.

Any servicer gets the RPC by listing ``GenerateManyMixin`` before the
generated ``WorkerServicer``; it imports neither torch nor the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from contract import worker_pb2 as pb

logger = logging.getLogger(__name__)


class CallAborted(Exception):
    """What ``abort`` raises for a framed call: the status its ``Generate`` ended with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class FramedCallContext:
    """The part of ``grpc.aio.ServicerContext`` a ``Generate`` method uses, for one framed call."""

    def __init__(self, stream_context: Any) -> None:
        self._stream = stream_context

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise CallAborted(code, details)

    def invocation_metadata(self) -> Any:
        return self._stream.invocation_metadata()

    def peer(self) -> str:
        return str(self._stream.peer())


def _status(call_id: int, code: grpc.StatusCode, details: str) -> pb.ReplyFrame:
    return pb.ReplyFrame(call_id=call_id, status=pb.CallStatus(code=code.value[0], details=details))


class GenerateManyMixin:
    """Implements ``GenerateMany`` on top of the class's own ``Generate``."""

    # Set by a worker that is shutting down: framed calls that arrive now are refused
    # as UNAVAILABLE (another worker can serve them), as a draining server refuses
    # new ``Generate`` calls; calls already running finish.
    draining: bool = False

    def Generate(self, request: Any, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        raise NotImplementedError  # provided by the servicer

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.CallFrames], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReplyFrames]:
        replies: asyncio.Queue[pb.ReplyFrame | None] = asyncio.Queue()
        calls: dict[int, asyncio.Task[None]] = {}
        framed = FramedCallContext(context)

        async def run(call_id: int, request: pb.GenerateRequest) -> None:
            finished = False
            try:
                if self.draining:
                    await framed.abort(grpc.StatusCode.UNAVAILABLE, "the worker is draining")
                async for msg in self.Generate(request, framed):
                    finished = msg.finished
                    replies.put_nowait(pb.ReplyFrame(call_id=call_id, response=msg))
                if not finished:  # as Generate's stream ending without a finished chunk
                    replies.put_nowait(_status(call_id, grpc.StatusCode.OK, ""))
            except CallAborted as exc:
                replies.put_nowait(_status(call_id, exc.code, exc.details))
            except Exception as exc:  # what grpc reports as UNKNOWN for a Generate call
                logger.exception("framed call %d (%s) failed", call_id, request.request_id)
                replies.put_nowait(_status(call_id, grpc.StatusCode.UNKNOWN, repr(exc)))
            finally:
                calls.pop(call_id, None)

        async def take_calls() -> None:
            try:
                async for batch in request_iterator:
                    for frame in batch.frames:
                        if frame.HasField("request"):
                            calls[frame.call_id] = asyncio.ensure_future(
                                run(frame.call_id, frame.request)
                            )
                        elif frame.cancel:
                            task = calls.pop(frame.call_id, None)
                            if task is not None:
                                task.cancel()
                # The gateway is done sending: end the stream once every call has ended.
                while calls:
                    await asyncio.wait(list(calls.values()))
            finally:
                replies.put_nowait(None)

        taker = asyncio.ensure_future(take_calls())
        try:
            while True:
                first = await replies.get()
                batch = [first]
                while not replies.empty():
                    batch.append(replies.get_nowait())
                done = None in batch
                frames = [f for f in batch if f is not None]
                if frames:
                    yield pb.ReplyFrames(frames=frames)
                if done:
                    break
            if taker.done() and not taker.cancelled():
                taker.result()  # a broken request stream fails this one too
        finally:
            # The gateway went away (or the stream failed): abort whatever still runs.
            pending = [taker, *calls.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
