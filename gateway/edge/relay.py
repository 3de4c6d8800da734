"""The last step of a request: a worker's token stream relayed to the client as text.

One JSON body, or server-sent events ending in ``data: [DONE]``. Stop strings
are matched here (``openai_api.detokenizer``); a match, or a client that goes
away, closes the upstream call, which aborts the request on the worker. A
stream's status line and headers go out as soon as the request is routed
(``start_sse``), before the worker's first token, as vLLM sends them: a client
queued on a busy worker is not left without headers. A failure after that is
reported in-band, as vLLM does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.routing.dispatch import Job, Stream
from gateway.upstream.base import Chunk, UpstreamError
from openai_api.detokenizer import Detokenizer
from openai_api.errors import APIError
from openai_api.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs, decoder
from openai_api.requests import SamplingRequest
from openai_api.responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_dict,
)

logger = logging.getLogger(__name__)


def route_headers(worker_id: str, reason: str) -> dict[str, str]:
    return {"x-kvroute-worker": worker_id, "x-kvroute-reason": reason}


class Relay:
    """Turns one worker stream into text, tracking usage as the worker reports it."""

    def __init__(
        self, tokenizer: Any, model: str, job: Job, s: SamplingRequest, chat: bool
    ) -> None:
        self.s = s
        self.chat = chat
        self.model = model
        self.rid = job.request_id
        self.prompt_tokens = len(job.prompt_ids)
        self.detok = Detokenizer(tokenizer, job.prompt_ids, s.stop)
        self.completion_tokens = 0
        self.cached_tokens: int | None = None
        self._stream: Stream | None = None
        self._resp: web.StreamResponse | None = None
        self._created = int(time.time())
        self._lp_pending: list[TokenLogprobs] = []
        self._decode = decoder(tokenizer)
        self._sent_chars = 0  # text already streamed (completions' text_offset)

    @property
    def stream(self) -> Stream:
        if self._stream is None:
            raise RuntimeError("the relay has no worker stream yet")
        return self._stream

    def attach(self, stream: Stream) -> None:
        """The worker stream to relay (once ``Dispatcher.open`` returned it)."""
        self._stream = stream

    def _take(self, chunk: Chunk) -> str:
        self.completion_tokens += len(chunk.token_ids)
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens
        if self.s.logprobs is not None:
            self._lp_pending.extend(chunk.logprobs)
        return self.detok.push(chunk.token_ids)

    def _logprobs(self, text_offset: int) -> dict[str, Any] | None:
        """The logprobs object of the tokens taken since the last call (None if not asked)."""
        if self.s.logprobs is None:
            return None
        items, self._lp_pending = self._lp_pending, []
        top = self.s.logprobs
        if self.chat:
            return chat_logprobs(items, self._decode, top)
        return completion_logprobs(items, self._decode, top, text_offset)

    async def events(self) -> AsyncIterator[tuple[str, str | None]]:
        """Yields (text delta, finish reason or None) until the generation ends."""
        chunk: Chunk | None = self.stream.first
        while chunk is not None:
            delta = self._take(chunk)
            if self.detok.stopped:
                yield delta, "stop"
                return
            if chunk.finished:
                yield delta + self.detok.finish(), chunk.finish_reason or "stop"
                return
            if delta:
                yield delta, None
            chunk = await self.stream.next()
        raise APIError(502, "the worker ended the stream without finishing", code="worker_error")

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens or 0)

    async def json_body(self) -> web.Response:
        parts: list[str] = []
        finish = "stop"
        try:
            async for delta, reason in self.events():
                parts.append(delta)
                finish = reason or finish
        except UpstreamError as exc:
            raise exc.api_error from exc
        build = chat_response if self.chat else completion_response
        body = build(self.rid, self.model, "".join(parts), finish, self.usage(), self._logprobs(0))
        return web.json_response(
            body, headers=route_headers(self.stream.worker_id, self.stream.reason)
        )

    # -- server-sent events ------------------------------------------------------------

    @property
    def _usage_field(self) -> bool:
        return self.s.include_usage or self.s.continuous_usage_stats

    def _chunk(self, delta: str | None, finish: str | None) -> dict[str, Any]:
        # continuous_usage_stats: every chunk carries the usage so far (vLLM's extension).
        usage = self.usage() if self.s.continuous_usage_stats else None
        lps = self._logprobs(self._sent_chars)
        if lps is not None and not (lps.get("content") or lps.get("tokens")):
            lps = None  # nothing new since the last chunk
        self._sent_chars += len(delta or "")
        if not self.chat:
            return completion_chunk(
                self.rid, self.model, self._created, delta, finish, usage, self._usage_field, lps
            )
        d = None if delta is None else ({"content": delta} if delta else {})
        return chat_chunk(
            self.rid, self.model, self._created, d, finish, usage, self._usage_field, lps
        )

    async def _send(self, obj: dict[str, Any]) -> None:
        if self._resp is None:
            raise RuntimeError("start_sse was not called")
        await self._resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    async def start_sse(
        self, request: web.Request, worker_id: str, reason: str
    ) -> web.StreamResponse:
        """Sends the status line, the routing headers and the chat role chunk.

        Called once the router chose ``worker_id``; if that worker fails before its
        first token and another one serves, the headers still name the first choice.
        """
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **route_headers(worker_id, reason),
            }
        )
        await resp.prepare(request)
        self._resp = resp
        if self.chat:
            role = {"role": "assistant", "content": ""}
            usage = self.usage() if self.s.continuous_usage_stats else None
            await self._send(
                chat_chunk(
                    self.rid, self.model, self._created, role, None, usage, self._usage_field
                )
            )
        return resp

    async def fail_sse(self, err: APIError) -> web.StreamResponse:
        """Ends a started stream with an in-band error (no worker could take the request)."""
        logger.warning("request %s failed before its first token: %s", self.rid, err.message)
        await self._send(err.body())
        return await self._done()

    async def sse(self) -> web.StreamResponse:
        """Relays the attached stream as events after ``start_sse``."""
        try:
            async for delta, finish in self.events():
                if delta:
                    await self._send(self._chunk(delta, None))
                if finish is not None:
                    await self._send(self._chunk("", finish))
        except (UpstreamError, APIError) as exc:
            err = exc.api_error if isinstance(exc, UpstreamError) else exc
            logger.warning(
                "request %s on worker %s failed mid-stream: %s",
                self.rid,
                self.stream.worker_id,
                err.message,
            )
            await self._send(err.body())
        return await self._done()

    async def _done(self) -> web.StreamResponse:
        if self._resp is None:
            raise RuntimeError("start_sse was not called")
        if self.s.include_usage:
            build = chat_chunk if self.chat else completion_chunk
            await self._send(
                build(self.rid, self.model, self._created, None, None, self.usage(), True)
            )
        await self._resp.write(b"data: [DONE]\n\n")
        await self._resp.write_eof()
        return self._resp
