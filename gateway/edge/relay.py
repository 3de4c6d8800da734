"""The last step of a request: a worker's token stream relayed to the client as text.

One JSON body, or server-sent events ending in ``data: [DONE]``. Stop strings
are matched here (``openai_api.detokenizer``); a match, or a client that goes
away, closes the upstream call, which aborts the request on the worker. A
failure after the status line went out is reported in-band, as vLLM does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.routing.dispatch import Stream
from gateway.upstream.base import Chunk, UpstreamError
from openai_api.detokenizer import Detokenizer
from openai_api.errors import APIError
from openai_api.requests import SamplingRequest
from openai_api.responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_dict,
)

logger = logging.getLogger(__name__)


def route_headers(stream: Stream) -> dict[str, str]:
    return {"x-kvroute-worker": stream.worker_id, "x-kvroute-reason": stream.reason}


class Relay:
    """Turns one worker stream into text, tracking usage as the worker reports it."""

    def __init__(
        self, tokenizer: Any, model: str, stream: Stream, s: SamplingRequest, chat: bool
    ) -> None:
        self.stream = stream
        self.s = s
        self.chat = chat
        self.model = model
        self.rid = stream.job.request_id
        self.prompt_tokens = len(stream.job.prompt_ids)
        self.detok = Detokenizer(tokenizer, stream.job.prompt_ids, s.stop)
        self.completion_tokens = 0
        self.cached_tokens: int | None = None

    def _take(self, chunk: Chunk) -> str:
        self.completion_tokens += len(chunk.token_ids)
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens
        return self.detok.push(chunk.token_ids)

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
        body = build(self.rid, self.model, "".join(parts), finish, self.usage())
        return web.json_response(body, headers=route_headers(self.stream))

    def _chunk(self, delta: str | None, finish: str | None, created: int) -> dict[str, Any]:
        usage_field = self.s.include_usage
        if not self.chat:
            return completion_chunk(self.rid, self.model, created, delta, finish, None, usage_field)
        d = None if delta is None else ({"content": delta} if delta else {})
        return chat_chunk(self.rid, self.model, created, d, finish, None, usage_field)

    async def sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **route_headers(self.stream),
            }
        )
        await resp.prepare(request)
        created = int(time.time())

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if self.chat:
            role = {"role": "assistant", "content": ""}
            await send(
                chat_chunk(self.rid, self.model, created, role, None, None, self.s.include_usage)
            )
        try:
            async for delta, finish in self.events():
                if delta:
                    await send(self._chunk(delta, None, created))
                if finish is not None:
                    await send(self._chunk("", finish, created))
        except (UpstreamError, APIError) as exc:
            err = exc.api_error if isinstance(exc, UpstreamError) else exc
            logger.warning(
                "request %s on worker %s failed mid-stream: %s",
                self.rid,
                self.stream.worker_id,
                err.message,
            )
            await send(err.body())
        if self.s.include_usage:
            build = chat_chunk if self.chat else completion_chunk
            await send(build(self.rid, self.model, created, None, None, self.usage(), True))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
