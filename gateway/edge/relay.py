"""The last step of a request: the workers' token streams relayed to the client as text.

One JSON body, or server-sent events ending in ``data: [DONE]``. Stop strings
are matched here (``openai_api.detokenizer``); a match, or a client that goes
away, closes the upstream call, which aborts the request on the worker. A
stream's status line and headers go out as soon as the request is routed
(``start_sse``), before the worker's first token, as vLLM sends them: a client
queued on a busy worker is not left without headers. A failure after that is
reported in-band, as vLLM does.

A request with ``n`` > 1 has one stream per choice (all on one worker); each
choice has its own detokenizer, and their chunks are interleaved as they come,
each with its ``index``. Usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.routing.jobs import Job, Stream
from gateway.upstream.base import Chunk, UpstreamError
from openai_api.detokenizer import Detokenizer
from openai_api.errors import APIError
from openai_api.json_body import dumps
from openai_api.logprobs import (
    Decode,
    TokenLogprobs,
    chat_logprobs,
    completion_logprobs,
    decoder,
)
from openai_api.responses import (
    chat_choice,
    chat_chunk,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_response,
    usage_dict,
)
from openai_api.sampling import SamplingRequest
from openai_api.tools import ToolCallStream, Tools, call_deltas

logger = logging.getLogger(__name__)


def route_headers(worker_id: str, reason: str) -> dict[str, str]:
    return {"x-kvroute-worker": worker_id, "x-kvroute-reason": reason}


def _unfinished() -> APIError:
    return APIError(502, "the worker ended the stream without finishing", code="worker_error")


class _Choice:
    """One choice's stream, text and logprobs."""

    def __init__(
        self,
        index: int,
        stream: Stream,
        tokenizer: Any,
        s: SamplingRequest,
        chat: bool,
        tools: ToolCallStream | None = None,
    ) -> None:
        self.index = index
        self.tools = tools  # set when the text is read for tool calls
        self.stream = stream
        self.s = s
        self.chat = chat
        self.detok = Detokenizer(
            tokenizer, stream.job.prompt_ids, s.stop, include_stop=s.include_stop_str_in_output
        )
        self.completion_tokens = 0
        self.cached_tokens: int | None = None
        self._lp_pending: list[TokenLogprobs] = []
        self._sent_chars = 0  # text already sent (completions' text_offset)

    def _count(self, chunk: Chunk) -> None:
        self.completion_tokens += len(chunk.token_ids)
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens
        if self.s.logprobs is not None:
            self._lp_pending.extend(chunk.logprobs)

    def _take(self, chunk: Chunk) -> str:
        self._count(chunk)
        return self.detok.push(chunk.token_ids)

    def take_logprobs(self) -> list[TokenLogprobs]:
        """The logprobs of the tokens taken since the last call."""
        items, self._lp_pending = self._lp_pending, []
        return items

    def logprobs(
        self, decode: Decode, text: str, items: list[TokenLogprobs] | None = None
    ) -> dict[str, Any] | None:
        """The logprobs of ``items`` (default: the tokens taken since the last call) in
        the response's shape; None if not asked or none."""
        if self.s.logprobs is None:
            return None
        if items is None:
            items = self.take_logprobs()
        offset, self._sent_chars = self._sent_chars, self._sent_chars + len(text)
        if self.chat:
            return chat_logprobs(items, decode, self.s.logprobs)
        return completion_logprobs(items, decode, self.s.logprobs, offset)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The tool calls found in the answer (once it finished)."""
        return self.tools.calls if self.tools is not None else []

    def _finish(self, delta: str, reason: str) -> tuple[str, str]:
        if self.tools is None:
            return delta, reason
        delta = self.tools.push(delta) + self.tools.finish()
        return delta, "tool_calls" if self.tools.calls else reason

    async def whole(self) -> tuple[str, str]:
        """The answer's text and finish reason, for a JSON body. With no stop string to
        find as text comes and no tool calls to parse, the ids are decoded once at the
        end (two tokenizer calls instead of two a token)."""
        if self.detok.has_stops or self.tools is not None:
            parts: list[str] = []
            finish = "stop"
            async for delta, reason in self.events():
                parts.append(delta)
                finish = reason or finish
            return "".join(parts), finish
        ids: list[int] = []
        chunk: Chunk | None = self.stream.first
        while chunk is not None:
            self._count(chunk)
            ids.extend(chunk.token_ids)
            if chunk.finished:
                return self.detok.push(ids) + self.detok.finish(), chunk.finish_reason or "stop"
            chunk = await self.stream.next()
        raise _unfinished()

    async def events(self) -> AsyncIterator[tuple[str, str | None]]:
        """Yields (text delta, finish reason or None) until the generation ends; with
        tools the text of a call is held back and ``tool_calls`` holds it at the end."""
        chunk: Chunk | None = self.stream.first
        while chunk is not None:
            delta = self._take(chunk)
            if self.detok.stopped:
                yield self._finish(delta, "stop")
                return
            if chunk.finished:
                yield self._finish(delta + self.detok.finish(), chunk.finish_reason or "stop")
                return
            if self.tools is not None:
                delta = self.tools.push(delta)
            if delta:
                yield delta, None
            chunk = await self.stream.next()
        raise _unfinished()


class Relay:
    """Turns the worker streams of one request into text, tracking usage as workers report it."""

    def __init__(
        self,
        tokenizer: Any,
        model: str,
        job: Job,
        s: SamplingRequest,
        chat: bool,
        tools: Tools | None = None,
        tool_format: str = "json",
    ) -> None:
        self.s = s
        self._tools = tools if tools is not None and tools.parsed else None
        self._tool_format = tool_format
        self.chat = chat
        self.model = model
        self.rid = job.request_id
        self.prompt_tokens = len(job.prompt_ids)
        self._tokenizer = tokenizer
        self._decode = decoder(tokenizer)
        self._choices: list[_Choice] = []
        self._resp: web.StreamResponse | None = None
        self._header_worker = ""  # the worker the response headers named
        self._created = int(time.time())

    def attach(self, streams: list[Stream]) -> None:
        """The worker streams to relay, one per choice (once ``Dispatcher.open`` returned them)."""
        self._choices = [
            _Choice(i, st, self._tokenizer, self.s, self.chat, self._tool_stream())
            for i, st in enumerate(streams)
        ]

    def _tool_stream(self) -> ToolCallStream | None:
        if self._tools is None:
            return None
        return ToolCallStream(self._tools, self._tool_format)

    @property
    def stream(self) -> Stream:
        """The first choice's stream (the one routing chose)."""
        if not self._choices:
            raise RuntimeError("the relay has no worker stream yet")
        return self._choices[0].stream

    @property
    def detok(self) -> Detokenizer:
        """The first choice's text (the answer a follow-up turn resends)."""
        return self._choices[0].detok

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self._choices)

    @property
    def cached_tokens(self) -> int | None:
        return self._choices[0].cached_tokens if self._choices else None

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens or 0)

    async def json_body(self) -> web.Response:
        async def collect(c: _Choice) -> dict[str, Any]:
            text, finish = await c.whole()
            if not self.chat:
                return completion_choice(c.index, text, finish, c.logprobs(self._decode, ""))
            lps = c.logprobs(self._decode, "")
            if c.tools is None:
                return chat_choice(c.index, text, finish, lps)
            return chat_choice(c.index, c.tools.content(), finish, lps, c.tool_calls)

        try:
            if len(self._choices) == 1:  # no task per request for the usual single choice
                choices = [await collect(self._choices[0])]
            else:
                choices = list(await asyncio.gather(*(collect(c) for c in self._choices)))
        except UpstreamError as exc:
            raise exc.api_error from exc
        build = chat_response if self.chat else completion_response
        body = build(self.rid, self.model, choices, self.usage())
        return web.Response(
            body=dumps(body, nonfinite=self.s.logprobs is not None),
            content_type="application/json",
            headers=route_headers(self.stream.worker_id, self.stream.reason),
        )

    # -- server-sent events ------------------------------------------------------------

    @property
    def _usage_field(self) -> bool:
        return self.s.include_usage or self.s.continuous_usage_stats

    def _chunk(
        self,
        c: _Choice,
        delta: str,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> dict[str, Any]:
        # continuous_usage_stats: every chunk carries the usage so far (vLLM's extension).
        usage = self.usage() if self.s.continuous_usage_stats else None
        lps = c.logprobs(self._decode, delta, logprobs)
        if lps is not None and not (lps.get("content") or lps.get("tokens")):
            lps = None  # nothing new since the last chunk
        args = (usage, self._usage_field, lps, c.index)
        if not self.chat:
            return completion_chunk(self.rid, self.model, self._created, delta, finish, *args)
        d: dict[str, Any] = {"content": delta} if delta else {}
        if tool_calls:
            d["tool_calls"] = tool_calls
        return chat_chunk(self.rid, self.model, self._created, d, finish, *args)

    async def _send(self, obj: dict[str, Any]) -> None:
        if self._resp is None:
            raise RuntimeError("start_sse was not called")
        lps = self.s.logprobs is not None
        await self._resp.write(b"data: " + dumps(obj, nonfinite=lps) + b"\n\n")

    async def start_sse(
        self, request: web.Request, worker_id: str, reason: str
    ) -> web.StreamResponse:
        """Sends the status line, the routing headers and the chat role chunk(s).

        Called once the router chose ``worker_id``; if that worker fails before its
        first token and another one serves, the headers still name the first choice,
        so ``sse`` then names the serving worker in an SSE comment line
        (``: x-kvroute-worker: ID``), which clients ignore and tools can read.
        """
        self._header_worker = worker_id
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
            usage = self.usage() if self.s.continuous_usage_stats else None
            for i in range(self.s.n):
                role = {"role": "assistant", "content": ""}
                await self._send(
                    chat_chunk(
                        self.rid,
                        self.model,
                        self._created,
                        role,
                        None,
                        usage,
                        self._usage_field,
                        None,
                        i,
                    )
                )
        return resp

    async def fail_sse(self, err: APIError) -> web.StreamResponse:
        """Ends a started stream with an in-band error (no worker could take the request)."""
        logger.warning("request %s failed before its first token: %s", self.rid, err.message)
        await self._send(err.body())
        return await self._done()

    async def sse(self) -> web.StreamResponse:
        """Relays the attached streams as events after ``start_sse``.

        Each worker message becomes at most one text event (one detokenizer
        push, one JSON encoding, one write), however many tokens it carries
        (a worker that fell behind, or ``--stream-interval``); the finish goes
        in its own event, as OpenAI's does. One reading task per choice, even
        for one: it asks the worker for the next message while the last event
        is written, which measured cheaper behind bench_overhead's fakes (9.0
        vs 10.4 ms CPU a stream_128 request) than reading after each write.
        """
        if self._resp is not None and self.stream.worker_id != self._header_worker:
            await self._resp.write(
                f": x-kvroute-worker: {self.stream.worker_id}\n"
                f": x-kvroute-reason: {self.stream.reason}\n\n".encode()
            )
        queue: asyncio.Queue[
            tuple[_Choice, str, str | None, list[TokenLogprobs]] | BaseException | None
        ] = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for delta, finish in c.events():
                    # The logprobs go with their text: the pump reads ahead while
                    # the last event is written, and takes the next tokens' too.
                    await queue.put((c, delta, finish, c.take_logprobs()))
                await queue.put(None)
            except (UpstreamError, APIError) as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(c)) for c in self._choices]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    err = item.api_error if isinstance(item, UpstreamError) else item
                    if not isinstance(err, APIError):
                        raise item
                    logger.warning(
                        "request %s on worker %s failed mid-stream: %s",
                        self.rid,
                        self.stream.worker_id,
                        err.message,
                    )
                    await self._send(err.body())
                    break
                c, delta, finish, lps = item
                if delta:
                    await self._send(self._chunk(c, delta, None, logprobs=lps))
                    lps = []
                if finish is not None and c.tool_calls:
                    calls = call_deltas(c.tool_calls)
                    await self._send(self._chunk(c, "", None, calls, logprobs=lps))
                    lps = []
                if finish is not None:
                    await self._send(self._chunk(c, "", finish, logprobs=lps))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
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
