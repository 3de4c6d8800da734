"""One request's output stream: the engine thread fills it, the request's event loop reads it.

The engine thread ``push``es each ``RequestOutput`` (or the error that ended
the request) with ``loop.call_soon_threadsafe``, so it never waits on a
consumer. The reader iterates the stream: every output already queued when it
asks comes out as one, merged by ``merge_outputs``, so a reader that falls
behind gets fewer, larger outputs. With ``stream_interval`` N > 1 an output
waits until it holds N tokens, except the first (TTFT) and the last; outputs
ready before an error come out first, then the error is raised.
"""

from __future__ import annotations

import asyncio
import logging

from worker.engine.types import RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["OutputStream", "merge_outputs"]


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive outputs of a request: their tokens and logprobs in order,
    the prompt and cached counts of the first, the rest (finish, usage, TTFT) of the last."""
    first, last = outputs[0], outputs[-1]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        completion_tokens=last.completion_tokens,
        ttft_s=last.ttft_s if last.ttft_s is not None else first.ttft_s,
        new_logprobs=[lp for o in outputs for lp in o.new_logprobs],
    )


class OutputStream:
    """Where one request's outputs go (a queue on the loop that reads them), and its reader.

    ``finished`` turns true once the last output came out or the error was
    raised: a stream left before that still has a request running.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stream_interval: int = 1) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.stream_interval = stream_interval
        self.finished = False
        self._held: list[RequestOutput] = []  # ready, not yet sent (< stream_interval tokens)
        self._error: BaseException | None = None
        self._sent = False  # the first output (TTFT) never waits for stream_interval

    def push(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Queues ``item`` from any thread; dropped if the reader's loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            logger.debug("dropping output for %s: event loop closed", request_id)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        items = self.queue
        while not self.finished:
            if self._error is not None:
                self.finished = True
                raise self._error
            item = await items.get()
            held = self._held
            while True:  # take every output already queued (nothing follows the last)
                if isinstance(item, BaseException):
                    self._error = item
                    break
                held.append(item)
                if item.finished or items.empty():
                    break
                item = items.get_nowait()
            if not held:
                continue
            if (
                self.stream_interval > 1
                and self._sent
                and self._error is None
                and not held[-1].finished
                and sum(len(o.new_token_ids) for o in held) < self.stream_interval
            ):
                continue  # --stream-interval: wait for more
            out = held[0] if len(held) == 1 else merge_outputs(held)
            self._held = []
            self._sent = True
            self.finished = out.finished
            return out
        raise StopAsyncIteration
