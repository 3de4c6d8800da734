"""The OpenAI-HTTP upstream: workers that speak ``/v1/completions`` (vLLM behind the bridge).

The gateway already rendered and tokenized the request (chat too), so the
worker gets the very ids the router hashed, as ``prompt`` (a list of token
ids), streamed, with ``return_token_ids`` so each chunk carries the new ids
and ``stream_options.include_usage`` so the last one carries usage, including
``prompt_tokens_details.cached_tokens``. Text is never taken from the worker:
the gateway detokenizes as it does for gRPC workers.

Failures map to ``UpstreamError``: no connection, 5xx, 404, 429 are
retryable (another worker may serve it); 400 is the client's; a timeout is
504. Cancelling closes the HTTP connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import orjson

from gateway.upstream.base import Chunk, Generation, UpstreamError
from gateway.upstream.http1 import Connection, Pool, Target
from openai_api.errors import APIError
from openai_api.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "text/event-stream",
    "User-Agent": "kvroute",
}
# At most this long, after an answer's end, for the rest of its response to arrive
# (``Pool.release_when_complete``): vLLM writes ``[DONE]`` and ends the response just
# after the usage; a response left unread would cost the next request a new connection.
_DRAIN_S = 0.5


def completion_body(g: Generation) -> dict[str, Any]:
    """The ``/v1/completions`` request for a generation (the worker's default model)."""
    body: dict[str, Any] = {
        "prompt": list(g.prompt_ids),
        "max_tokens": g.max_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p if g.top_p > 0 else 1.0,
        "top_k": g.top_k if g.top_k > 0 else 0,
        "ignore_eos": g.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if g.stop_token_ids:
        body["stop_token_ids"] = list(g.stop_token_ids)
    if g.seed is not None:
        body["seed"] = g.seed
    # vLLM implements these itself.
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        if getattr(g, name):
            body[name] = getattr(g, name)
    if g.repetition_penalty != 1.0:
        body["repetition_penalty"] = g.repetition_penalty
    if g.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in g.logit_bias}
    if g.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": json.loads(g.json_schema)},
        }
    if g.grammar is not None:
        # vLLM's guidance backend takes the same llguidance Lark grammar.
        body["structured_outputs"] = {"grammar": g.grammar}
    if g.logprobs is not None:
        body["logprobs"] = g.logprobs
        body["return_tokens_as_token_ids"] = True  # tokens come back as "token_id:<id>"
    if g.cache_salt:
        body["cache_salt"] = g.cache_salt  # vLLM folds it into block 0's hash, as kvroute does
    return body


_ECHO = b'"prompt_token_ids":['


def _without_prompt_echo(data: bytes) -> bytes:
    """An SSE event without the prompt's ids that vLLM echoes in the first event of a
    ``return_token_ids`` stream: the gateway sent them, and a 6k-token prompt's are
    30 kB to parse for nothing (a list of ints holds no ``]`` before its end)."""
    start = data.find(_ECHO)
    if start < 0:
        return data
    end = data.find(b"]", start)
    if end < 0:
        return data
    return data[:start] + b'"prompt_token_ids":null' + data[end + 1 :]


def _token_id(text: str) -> int | None:
    head, _, tail = text.partition(":")
    return int(tail) if head == "token_id" and tail.isdigit() else None


def _logprobs(ids: list[int], raw: Any) -> tuple[TokenLogprobs, ...]:
    """vLLM's completion logprobs (tokens as ``token_id:<id>``) as ``TokenLogprobs``."""
    if not isinstance(raw, dict):
        return ()
    values = raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or [None] * len(values)
    out = []
    for token, value, top in zip(ids, values, tops, strict=False):
        alternatives = []
        for key, v in (top or {}).items():
            tid = _token_id(str(key))
            if tid is not None and v is not None:
                alternatives.append((tid, float(v)))
        alternatives.sort(key=lambda a: -a[1])
        out.append(TokenLogprobs(token, float(value or 0.0), tuple(alternatives)))
    return tuple(out)


def _error(status: int, detail: str) -> UpstreamError:
    if status == 400:
        api = APIError(400, f"the worker rejected the request: {detail}", code="invalid_request")
        return UpstreamError(f"HTTP 400: {detail}", retryable=False, api_error=api)
    api = APIError(502, f"worker error HTTP {status}: {detail}", code="worker_error")
    return UpstreamError(f"HTTP {status}: {detail}", retryable=True, api_error=api)


def _unreachable(exc: BaseException) -> UpstreamError:
    api = APIError(502, f"worker unreachable: {exc}", code="worker_error")
    return UpstreamError(f"unreachable: {exc!r}", retryable=True, api_error=api)


def _timeout() -> UpstreamError:
    return UpstreamError(
        "timed out",
        retryable=False,
        api_error=APIError(504, "the request timed out", code="timeout"),
    )


def _detail(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        return str(data.get("error", {}).get("message") or data)[:500]
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:500]


class _HttpCall:
    """One streamed completion; the request starts on the first ``read``.

    vLLM writes an SSE event per token (per ``--stream-interval`` tokens): every read
    takes all the events that have arrived and returns their tokens as one chunk, so a
    gateway that reads behind a fast worker relays fewer, larger chunks (as a kvroute
    worker's stream interval does), and a read costs one parse of each event (orjson),
    not a line read per line and a task per wait.

    A read stopped by ``read_within`` may stop at any of its awaits: none consumes
    what it waits for, and the request is sent once (a connect in progress goes on
    as a task of its own).
    """

    def __init__(
        self,
        upstream: OpenAIHTTPUpstream,
        target: Target,
        body: dict[str, Any],
        timeout_s: float,
        request_id: str,
    ):
        self._upstream = upstream
        self._target = target
        self._body = body
        self._request_id = request_id
        self._timeout_s = timeout_s
        self._conn: Connection | None = None  # the request is on it
        self._connecting: asyncio.Future[Connection] | None = None
        self._sent_on_pooled = False  # the request went out on a reused connection
        self._opened = False  # a 200's head is in
        self._deadline: asyncio.TimerHandle | None = None
        self._expired = False
        self._buf = b""  # bytes read past the last complete line
        self._finish: Chunk | None = None  # a finished chunk waiting for the usage chunk
        self._error: UpstreamError | None = None  # raised once the tokens before it are read
        self._cached: int | None = None  # from the usage that follows the finish
        self._done = False
        self._cancelled = False

    @property
    def _url(self) -> str:
        t = self._target
        return f"{'https' if t.tls else 'http'}://{t.host}:{t.port}"

    async def read(self) -> Chunk | None:
        if self._done:
            return None
        if self._cancelled:
            raise UpstreamError("cancelled", retryable=False, api_error=APIError(499, "cancelled"))
        try:
            if not self._opened:
                await self._open()
            return await self._next()
        except TimeoutError as exc:  # the call's whole time is up (``_expire``)
            self.cancel()
            raise _timeout() from exc
        except OSError as exc:  # refused, reset, closed mid-response, not HTTP
            self.cancel()
            raise _unreachable(exc) from exc

    async def read_within(self, limit_s: float) -> Chunk | None:
        """``read``, or ``TimeoutError``: a read stopped while it waits has taken
        nothing, so the call reads on afterwards."""
        async with asyncio.timeout(limit_s):
            return await self.read()

    async def _open(self) -> None:
        if self._deadline is None:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(self._timeout_s, self._expire)
        while True:
            if self._conn is None:
                await self._send()
            conn = self._conn
            assert conn is not None
            try:
                status = await conn.head()
                break
            except ConnectionError:
                if not self._sent_on_pooled or conn.got_bytes:
                    raise
                # A pooled connection the server had closed while idle: it never read
                # the request, so it goes again on a new connection.
                conn.close()
                self._conn, self._sent_on_pooled = None, False
                self._upstream.pool.resent += 1
        if status != 200:
            detail = _detail(await conn.whole_body(64 * 1024))
            self._conn = None
            self._upstream.pool.release(conn)
            raise _error(status, detail)
        self._opened = True

    async def _send(self) -> None:
        if self._expired:  # the clock ran out while no connection held the request
            raise TimeoutError(f"no answer within {self._timeout_s:g}s")
        pool = self._upstream.pool
        conn = pool.take(self._target.key)
        self._sent_on_pooled = conn is not None
        if conn is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(pool.connect(self._target))
            # Shielded: a read stopped here leaves the connect going for the next read.
            conn = await asyncio.shield(self._connecting)
            self._connecting = None
            if self._expired:
                conn.close()
                raise TimeoutError(f"no answer within {self._timeout_s:g}s")
        # orjson: a 6k-token prompt's body encodes in 0.03 ms; aiohttp's json= took 0.31.
        conn.begin(self._target.request(orjson.dumps(self._body), self._request_id))
        self._conn = conn

    def _expire(self) -> None:
        self._deadline = None
        error = TimeoutError(f"no answer within {self._timeout_s:g}s")
        if self._conn is not None:
            self._conn.fail(error)
        else:  # connecting (bounded by the connect timeout) or about to send again
            self._expired = True

    async def _next(self) -> Chunk | None:
        conn = self._conn
        assert conn is not None
        ids: list[int] = []
        lps: list[TokenLogprobs] = []
        while True:
            if self._error is not None:
                error, self._error = self._error, None
                self._done = True
                self._close()
                raise error
            lines = self._buf.split(b"\n")
            self._buf = lines.pop()
            for line in lines:
                if self._event(line.strip(), ids, lps):  # [DONE]
                    return self._end()
            if ids and self._finish is None:
                return Chunk(ids, logprobs=tuple(lps))
            if self._finish is not None and self._cached is not None:
                return self._end()  # the usage came: the answer is complete
            # The one await: a read stopped here (``read_within``) has consumed nothing.
            data = await conn.read()
            if not data:  # the worker closed the stream
                self._event(self._buf.strip(), ids, lps)  # a last line without its newline
                self._buf = b""
                return self._end()
            self._buf += data

    def _event(self, line: bytes, ids: list[int], lps: list[TokenLogprobs]) -> bool:
        """Takes one SSE line's tokens into ``ids`` (or its usage, or its error); True
        at ``[DONE]``."""
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            msg = orjson.loads(_without_prompt_echo(data))
        except orjson.JSONDecodeError:
            logger.warning("worker %s sent an undecodable SSE line: %r", self._url, data[:200])
            return False
        if not isinstance(msg, dict):
            return False
        if "error" in msg:
            err = msg["error"] if isinstance(msg["error"], dict) else {"message": msg["error"]}
            error = _error(int(err.get("code") or 500), str(err.get("message")))
            if not ids:
                raise error
            self._error = error  # after the tokens read before it
            return False
        usage = msg.get("usage")
        if usage and self._finish is not None:
            details = usage.get("prompt_tokens_details") or {}
            self._cached = int(details.get("cached_tokens") or 0)
            return False
        for choice in msg.get("choices") or ():
            new = [int(t) for t in choice.get("token_ids") or ()]
            ids.extend(new)
            if choice.get("logprobs") is not None:
                lps.extend(_logprobs(new, choice["logprobs"]))
            reason = choice.get("finish_reason")
            if reason:
                reason = _FINISH_REASONS.get(str(reason), "stop")
                self._finish = Chunk(list(ids), True, reason, logprobs=tuple(lps))
                ids.clear()
                lps.clear()
        return False

    def _end(self) -> Chunk:
        """The held finished chunk, with the usage's cached tokens if they came. The rest
        of the response ([DONE], the chunked end) is read behind the answer, so that its
        connection goes back to the pool without the answer waiting for it."""
        self._done = True
        f = self._finish
        if f is None:
            self._close()
            # The stream ended without a finish_reason: the worker went away mid-answer.
            raise _unreachable(ConnectionError("stream ended before the answer finished"))
        self._stop_clock()
        conn, self._conn = self._conn, None
        if conn is not None:
            self._upstream.pool.release_when_complete(conn, _DRAIN_S)
        return Chunk(f.token_ids, True, f.finish_reason, self._cached, f.logprobs)

    def cancel(self) -> None:
        """Closes the connection: vLLM aborts a request whose client went away."""
        self._cancelled = not self._done
        self._close()

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self) -> None:
        self._stop_clock()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        connecting, self._connecting = self._connecting, None
        if connecting is not None:  # the connection it opens is not wanted
            connecting.add_done_callback(_close_connected)


def _close_connected(connecting: asyncio.Future[Connection]) -> None:
    if not connecting.cancelled() and connecting.exception() is None:
        connecting.result().close()


class OpenAIHTTPUpstream:
    """Streams completions from OpenAI-compatible workers over pooled HTTP/1.1 connections."""

    def __init__(self, *, connect_timeout_s: float = 2.0) -> None:
        self.pool = Pool(connect_timeout_s)
        self._targets: dict[str, Target] = {}

    def start(
        self,
        worker_id: str,
        address: str,
        generation: Generation,
        timeout_s: float,
        *,
        frames_address: str = "",
        prompt_encoding: str = "",
    ) -> _HttpCall:
        """A call to ``address`` (the worker's base URL; ``host:port`` means http).

        ``frames_address`` is a kvroute worker's; an OpenAI HTTP worker has none.
        """
        target = self._targets.get(address)
        if target is None:
            base = address if "://" in address else f"http://{address}"
            target = Target(f"{base.rstrip('/')}/v1/completions", _HEADERS)
            if len(self._targets) > 4096:  # addresses of workers long gone
                self._targets.clear()
            self._targets[address] = target
        # The id vLLM gets (``X-Request-Id``) is unique per try: the dispatcher names a
        # retry ``<id>-<attempt>``, as vLLM needs with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION.
        body = completion_body(generation)
        return _HttpCall(self, target, body, timeout_s, generation.request_id)

    def connect(self, worker_id: str, address: str, *, frames_address: str = "") -> None:
        """Nothing ahead of time: the pool opens connections as requests need them."""

    def forget(self, worker_id: str) -> None:
        """Nothing per worker: idle connections expire on their own."""

    async def close(self) -> None:
        self.pool.close()
