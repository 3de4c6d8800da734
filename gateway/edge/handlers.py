"""The OpenAI endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Each handler: read and validate the body, tokenize (chat template for chat),
check the context limit, hand a ``Job`` to the dispatcher, then relay the
worker's token stream as text — one JSON body, or server-sent events ending
in ``data: [DONE]``. Stop strings are matched here; a match (or a client that
goes away) cancels the gRPC call, which aborts the request on the worker.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import grpc
from aiohttp import web

from contract import worker_pb2
from gateway.edge.app_keys import STATE, TENANT, GatewayState
from gateway.edge.auth import ANONYMOUS, Tenant
from gateway.edge.errors import APIError
from gateway.protocol import (
    SamplingRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    parse_chat,
    parse_completion,
    usage_dict,
)
from gateway.routing.dispatch import Job, Stream
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.prefix_tokens import Prompt

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"


async def read_json(request: web.Request) -> Any:
    """The decoded JSON body; 413 past the size limit, 400 when not JSON."""
    raw = await request.read()  # aiohttp raises 413 past client_max_size
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"invalid JSON body: {exc}", code="invalid_json") from exc


def _check_model(state: GatewayState, model: str) -> None:
    if model != state.config.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this gateway serves '{state.config.model_name}'",
            param="model",
            code="model_not_found",
        )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    state = request.app[STATE]
    req = parse_chat(await read_json(request))
    _check_model(state, req.sampling.model)
    try:
        text = state.tokenizer.render(req.messages)
    except Exception as exc:  # jinja raises its own errors for templates that reject input
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    prompt = await state.tokenizer.aencode_rendered(text)
    return await _generate(request, state, req.sampling, prompt, started, messages=req.messages)


async def completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    state = request.app[STATE]
    req = parse_completion(await read_json(request))
    _check_model(state, req.sampling.model)
    if isinstance(req.prompt, str):
        prompt = await state.tokenizer.aencode_prompt(req.prompt)
    else:
        prompt = Prompt(list(req.prompt))
        if max(prompt.ids) >= state.tokenizer.vocab_size:
            raise APIError(400, "a prompt token id is outside the vocabulary", param="prompt")
    return await _generate(request, state, req.sampling, prompt, started, messages=None)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": state.config.model_name,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": "kvroute",
                    "max_model_len": state.dispatcher.max_model_len(state.tokenizer.max_model_len),
                }
            ],
        }
    )


def _sampling_pb(s: SamplingRequest, max_tokens: int) -> worker_pb2.SamplingParams:
    params = worker_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        params.seed = s.seed
    return params


def _session_key(request: web.Request, s: SamplingRequest, tenant: Tenant) -> str | None:
    key = request.headers.get(SESSION_HEADER) or s.user
    return f"{tenant.name}\x00{key}" if key else None


async def _generate(
    request: web.Request,
    state: GatewayState,
    s: SamplingRequest,
    prompt: Prompt,
    started: float,
    *,
    messages: tuple[dict[str, Any], ...] | None,
) -> web.StreamResponse:
    chat = messages is not None
    ids = prompt.ids
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    limit = state.dispatcher.max_model_len(state.tokenizer.max_model_len)
    if len(ids) >= limit:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens; this model's context is {limit}",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = s.max_tokens if s.max_tokens is not None else limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise APIError(
            400,
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
            f"the context of {limit} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    tenant = request.get(TENANT, ANONYMOUS)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    job = Job(
        request_id=rid,
        prompt=prompt,
        sampling=_sampling_pb(s, max_tokens),
        tenant=tenant,
        session_key=_session_key(request, s, tenant),
        started=started,
    )
    stream = await state.dispatcher.open(job)
    relay = _Relay(state, stream, s, ids)
    text, finish = "", "stop"
    try:
        if s.stream:
            resp = await relay.sse(request, rid, chat)
        else:
            text, finish = await relay.collect()
    finally:
        stream.close(relay.cached_tokens)
    if messages is not None:
        # Off the request's path: the next turn will resend this answer; tokenize it now.
        state.spawn(state.tokenizer.remember_answer(messages, relay.detok.output_text))
    if s.stream:
        return resp
    usage = relay.usage()
    body = (chat_response if chat else completion_response)(
        rid, state.config.model_name, text, finish, usage
    )
    return web.json_response(body, headers=_route_headers(stream))


def _route_headers(stream: Stream) -> dict[str, str]:
    return {"x-kvroute-worker": stream.worker_id, "x-kvroute-reason": stream.reason}


class _Relay:
    """Turns one worker stream into text, tracking usage as the worker reports it."""

    def __init__(
        self, state: GatewayState, stream: Stream, s: SamplingRequest, ids: list[int]
    ) -> None:
        self.stream = stream
        self.s = s
        self.prompt_tokens = len(ids)
        self.detok = IncrementalDetokenizer(state.tokenizer.tokenizer, ids, s.stop)
        self.completion_tokens = 0
        self.cached_tokens: int | None = None
        self.model = state.config.model_name

    def _take(self, msg: worker_pb2.GenerateResponse) -> str:
        self.completion_tokens += len(msg.token_ids)
        if msg.HasField("usage") and (msg.usage.prompt_tokens or msg.usage.cached_tokens):
            self.cached_tokens = msg.usage.cached_tokens
        return self.detok.push(msg.token_ids)

    async def events(self) -> Any:
        """Yields (text delta, finish reason or None) until the generation ends."""
        msg: worker_pb2.GenerateResponse | None = self.stream.first
        while msg is not None:
            delta = self._take(msg)
            if self.detok.stopped:
                yield delta, "stop"
                return
            if msg.finished:
                yield delta + self.detok.finish(), msg.finish_reason or "stop"
                return
            if delta:
                yield delta, None
            msg = await self.stream.next()
        raise APIError(502, "the worker ended the stream without finishing", code="worker_error")

    async def collect(self) -> tuple[str, str]:
        parts: list[str] = []
        finish = "stop"
        try:
            async for delta, reason in self.events():
                parts.append(delta)
                finish = reason or finish
        except grpc.aio.AioRpcError as exc:
            raise _midstream_error(exc) from exc
        return "".join(parts), finish

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens or 0)

    async def sse(self, request: web.Request, rid: str, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_route_headers(self.stream),
            }
        )
        await resp.prepare(request)
        created = int(time.time())
        with_usage = self.s.include_usage

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                d = (
                    None
                    if delta is None
                    else (
                        {"role": "assistant", "content": delta}
                        if first
                        else ({"content": delta} if delta else {})
                    )
                )
                return chat_chunk(rid, self.model, created, d, finish, None, with_usage)
            return completion_chunk(rid, self.model, created, delta, finish, None, with_usage)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if chat:
            await send(chunk("", None, first=True))
        try:
            async for delta, finish in self.events():
                if finish is None:
                    await send(chunk(delta, None))
                    continue
                if delta:
                    await send(chunk(delta, None))
                await send(chunk("", finish))
        except (grpc.aio.AioRpcError, APIError) as exc:
            err = _midstream_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc
            logger.warning(
                "request %s on worker %s failed mid-stream: %s",
                rid,
                self.stream.worker_id,
                err.message,
            )
            await send(err.body())
        if with_usage:
            final = (
                chat_chunk(rid, self.model, created, None, None, self.usage(), True)
                if chat
                else completion_chunk(rid, self.model, created, None, None, self.usage(), True)
            )
            await send(final)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _midstream_error(exc: grpc.aio.AioRpcError) -> APIError:
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request timed out", code="timeout")
    return APIError(502, f"worker error {exc.code().name}: {exc.details()}", code="worker_error")
