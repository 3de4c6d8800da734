"""A request's path through the gateway, top to bottom, in one function.

``serve`` runs these steps, each a call into the room that owns it:

1. parse      ``openai_api.requests``: the body, validated (400s name the field)
2. tenant     ``gateway.edge.auth``: set by the auth middleware (API key -> tenant + salt)
3. tokenize   ``gateway.text``: chat template and encoding, reusing cached prefixes
4. limits     the context window of the workers (400 ``context_length_exceeded``)
5. hash       ``gateway.routing.dispatch``: the block chain per worker hash spec
6. look up    ``gateway.routing.index``: each worker's longest cached prefix
7. choose     ``gateway.routing.router``: lowest predicted time to first token
8. open       ``gateway.upstream``: the worker's stream, retried elsewhere before
              its first token
9. relay      ``gateway.edge.relay``: text to the client as JSON or server-sent events

After a chat answer in a conversation past its first turn went out, the
history plus the answer is tokenized off the request's path, because the
client's next turn resends exactly that.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from gateway.edge.app_keys import STATE, TENANT, GatewayState
from gateway.edge.auth import ANONYMOUS, Tenant
from gateway.edge.relay import Relay
from gateway.observe.access_log import note_request, observe_finished
from gateway.routing.dispatch import Dispatcher
from gateway.routing.jobs import Candidates, Job, Stream
from gateway.routing.router import Decision
from gateway.text.prefix_tokens import Prompt
from gateway.upstream.base import Generation
from openai_api.errors import APIError
from openai_api.json_body import parse_body
from openai_api.requests import ChatRequest, CompletionRequest, parse_chat, parse_completion
from openai_api.sampling import SamplingRequest
from openai_api.tools import JSON, tool_format

SESSION_HEADER = "X-Session-ID"
MAX_SESSION_ID = 256  # characters of X-Session-ID (the ``user`` field is hashed whatever its size)
_OFF_LOOP_BYTES = 256 * 1024  # bodies this large are decoded in the executor
# Chats this long are rendered in the executor. Rendering costs per message (255 short
# ones: 0.56 ms), hardly per character (2 MB of content: 1 ms): below both, handing the
# render to a thread costs more than it saves (it holds the GIL there too).
_OFF_LOOP_MESSAGES = 256
_OFF_LOOP_RENDER_CHARS = 1 << 20
# No token is longer than this many characters in any tokenizer we serve: text longer
# than the context times this cannot fit, and is refused before it is rendered or encoded.
MAX_CHARS_PER_TOKEN = 64


async def serve(request: web.Request, *, chat: bool) -> web.StreamResponse:
    """``/v1/chat/completions`` (``chat``) or ``/v1/completions``, steps 1-9."""
    started = time.perf_counter()
    state = request.app[STATE]
    # 1. parse
    body = await read_json(request)
    req: ChatRequest | CompletionRequest = parse_chat(body) if chat else parse_completion(body)
    tool_fmt = JSON
    if isinstance(req, ChatRequest) and req.tools is not None:
        # A forced call is constrained to the call format of the model's chat template.
        tool_fmt = tool_format(state.tokenizer.tokenizer)
        req = req.with_tool_format(tool_fmt)
    s = req.sampling
    check_model(state, s.model)
    # 2. tenant
    tenant = request.get(TENANT, ANONYMOUS)
    # 3. tokenize
    tokenize_started = time.perf_counter()
    prompt = await tokenize(state, req)
    tokenize_s = time.perf_counter() - tokenize_started
    state.metrics.tokenize_seconds.observe(tokenize_s)
    # 4. limits
    max_tokens = fit_context(state, s, prompt, chat)
    # 32 random hex digits, as uuid4().hex gives, at a fifth of its cost (0.3 against 1.6 us)
    rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(16).hex()
    note_request(request, rid, tenant.name, tokenize_s)
    tools = req.tools if isinstance(req, ChatRequest) else None
    job = Job(
        request_id=rid,
        prompt=prompt,
        generation=generation(rid, prompt, s, max_tokens, tenant),
        tenant=tenant,
        session_key=session_key(request, s, tenant),
        started=started,
        max_tokens_fixed=s.max_tokens is not None,
        whole_answer=not s.stream and not s.stop and tools is None,
    )
    d = state.dispatcher
    # 5. hash
    candidates = d.hash(job, d.candidates())
    # 6. look up
    cached = await d.alook_up(candidates)
    # 7. choose
    decision = d.choose(job, candidates, cached)
    relay = Relay(
        state.tokenizer.tokenizer, served_name(state, s.model), job, s, chat, tools, tool_fmt
    )
    # A stream's headers go out once its request is on its way to the worker, not
    # with its first token: a client queued on a busy worker sees the routing headers
    # at once (vLLM, too, answers at once), and writing them costs the request nothing
    # (sent before the request, they were ~0.4 ms of every time to first token).
    headers: asyncio.Future[web.StreamResponse] | None = None

    def send_headers() -> None:
        nonlocal headers
        if s.stream and headers is None:
            headers = asyncio.ensure_future(
                relay.start_sse(request, decision.worker_id, decision.reason)
            )

    # 8. open
    try:
        streams = await open_choices(d, job, candidates, cached, decision, s.n, send_headers)
    except APIError as exc:
        if not s.stream:
            raise
        send_headers()
        assert headers is not None
        await headers
        return await relay.fail_sse(exc)
    except BaseException:
        if headers is not None:
            headers.cancel()  # nothing when it is done already
            if headers.done() and not headers.cancelled():
                headers.exception()  # its client going away is not a second error to log
        raise
    stream = streams[0]
    relay.attach(streams)
    # 9. relay
    try:
        if headers is not None:
            await headers
        resp = await (relay.sse() if s.stream else relay.json_body())
        if not resp.prepared:
            await send_now(request, resp)
    finally:
        for other in streams[1:]:
            other.close(None)
        stream.close(relay.cached_tokens)
        observe_finished(
            request, state.metrics, stream, relay.completion_tokens, relay.cached_tokens
        )
    # Pre-tokenizing the answer is speculative work for a next turn: only for a
    # conversation already past its first turn. Single-turn traffic never sends
    # one (it cost a saturated gateway 7.5 % of its CPU on bench_overhead's
    # chat_small), and a second turn finds its first prompt cached and encodes
    # only the first answer and its new message.
    if isinstance(req, ChatRequest) and any(m.get("role") == "assistant" for m in req.messages):
        answer = relay.detok.output_text
        if state.tokenizer.answer_is_new(prompt, answer):
            state.spawn(state.tokenizer.remember_answer(req.messages, answer))
    return resp


async def send_now(request: web.Request, resp: web.StreamResponse) -> None:
    """Sends a finished answer before the request's bookkeeping runs (closing its stream,
    metrics, the access log): the client waits for none of that. aiohttp then finds it
    sent; a client gone meanwhile is aiohttp's to handle, as for any response."""
    try:
        await resp.prepare(request)
        await resp.write_eof()
    except ConnectionError:
        pass


async def open_choices(
    d: Dispatcher,
    job: Job,
    candidates: Candidates,
    cached: dict[str, int],
    decision: Decision,
    n: int,
    on_sent: Callable[[], None] | None = None,
) -> list[Stream]:
    """The first choice's stream as routed; with ``n`` > 1 the others on the same worker.

    They are opened once the first produced its first token, so its prompt blocks are
    cached there and the other choices only compute the last, partial block.
    """
    streams = [await d.open(job, candidates, cached, decision, on_sent)]
    first = streams[0]
    pinned = Decision(
        first.worker_id, first.reason, first.predicted_cached_tokens, (first.worker_id,)
    )
    try:
        for i in range(1, n):
            seed = job.generation.seed
            generation = replace(
                job.generation,
                request_id=f"{job.request_id}-{i}",
                seed=None if seed is None else (seed + i) % 2**64,
            )
            choice = replace(job, request_id=generation.request_id, generation=generation)
            streams.append(await d.open(choice, candidates, cached, pinned))
    except BaseException:
        for st in streams:
            st.close(None)
        raise
    return streams


async def read_json(request: web.Request) -> Any:
    """The decoded JSON body; 413 past the size limit, 408 when too slow, 400 when not JSON
    (``openai_api.json_body``, the workers' parser too).

    A large body is decoded in the executor, so the loop never stalls on it.
    """
    try:
        if request.content.is_eof():  # the whole body is here: no timer to arm
            raw = await request.read()  # aiohttp raises 413 past client_max_size
        else:
            async with asyncio.timeout(request.app[STATE].config.client_body_timeout_s):
                raw = await request.read()
    except TimeoutError:
        raise APIError(408, "the request body did not arrive in time", code="timeout") from None
    if len(raw) >= _OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, parse_body, raw)
    return parse_body(raw)


def check_model(state: GatewayState, model: str) -> None:
    """404 unless ``model`` is empty or one of the served names (``--served-model-name``)."""
    names = state.config.model_names
    if model and model not in names:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this gateway serves {', '.join(names)}",
            param="model",
            code="model_not_found",
        )


def served_name(state: GatewayState, model: str) -> str:
    """The name responses carry: the one the client asked for, else the first served name."""
    return model or state.config.model_name


async def tokenize(state: GatewayState, req: ChatRequest | CompletionRequest) -> Prompt:
    """Token ids exactly as the workers compute them (chat template for chat)."""
    tok = state.tokenizer
    if isinstance(req, ChatRequest):
        render = functools.partial(
            tok.render,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            **req.template_args(),
        )
        size = sum(len(m["content"]) for m in req.messages)
        check_size(state, size, "messages")
        try:
            if size >= _OFF_LOOP_RENDER_CHARS or len(req.messages) >= _OFF_LOOP_MESSAGES:
                text = await asyncio.get_running_loop().run_in_executor(None, render)
            else:
                text = render()
        except Exception as exc:  # jinja raises its own errors for templates that reject input
            raise APIError(
                400, f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # A prompt the context will refuse is not remembered (rejected requests never
        # fill the prefix cache).
        limit = state.dispatcher.max_model_len(tok.max_model_len)
        return await tok.aencode_rendered(
            text, remember_below=limit - (req.sampling.max_tokens or 1)
        )
    if isinstance(req.prompt, str):
        check_size(state, len(req.prompt), "prompt")
        limit = state.dispatcher.max_model_len(tok.max_model_len)
        return await tok.aencode_prompt(
            req.prompt, remember_below=limit - (req.sampling.max_tokens or 1)
        )
    prompt = Prompt(list(req.prompt))
    if max(prompt.ids) >= tok.vocab_size:
        raise APIError(400, "a prompt token id is outside the vocabulary", param="prompt")
    return prompt


def check_size(state: GatewayState, chars: int, param: str) -> None:
    """A 400 for text too long for any context, before any work is spent on it."""
    limit = state.dispatcher.max_model_len(state.tokenizer.max_model_len)
    if chars > limit * MAX_CHARS_PER_TOKEN:
        raise APIError(
            400,
            f"the {param} hold {chars} characters, more than a {limit}-token context can take",
            param=param,
            code="context_length_exceeded",
        )


def fit_context(state: GatewayState, s: SamplingRequest, prompt: Prompt, chat: bool) -> int:
    """``max_tokens`` for the request (unset: what the context leaves), or 400."""
    n = len(prompt.ids)
    if not n:
        raise APIError(400, "the prompt is empty", param="prompt")
    limit = state.dispatcher.max_model_len(state.tokenizer.max_model_len)
    if n >= limit:
        raise APIError(
            400,
            f"the prompt has {n} tokens; this model's context is {limit}",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = s.max_tokens if s.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise APIError(
            400,
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
            f"the context of {limit} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def generation(
    rid: str, prompt: Prompt, s: SamplingRequest, max_tokens: int, tenant: Tenant
) -> Generation:
    # The tenant's salt always wins: a body's ``cache_salt`` never reaches a worker from here.
    return Generation(
        request_id=rid,
        prompt_ids=prompt.ids,
        max_tokens=max_tokens,
        cache_salt=tenant.cache_salt,
        **s.engine_options(),
    )


def session_key(request: web.Request, s: SamplingRequest, tenant: Tenant) -> str | None:
    """The session's key, hashed to a fixed size: a 4 MB ``user`` costs 32 bytes to remember."""
    header = request.headers.get(SESSION_HEADER)
    if header is not None and len(header) > MAX_SESSION_ID:
        raise APIError(
            400,
            f"{SESSION_HEADER} is longer than {MAX_SESSION_ID} characters",
            param=SESSION_HEADER,
        )
    key = header or s.user
    if not key:
        return None
    raw = f"{tenant.name}\x00{key}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
