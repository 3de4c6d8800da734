"""The worker's gRPC service (``kvroute.v1.Worker``): token ids in, token ids out.

The gateway owns tokenization, so ``Generate`` takes prompt token ids and
streams generated ids back (``GenerateMany`` carries many such calls on one
stream, ``worker.serve.grpc_mux``); the first chunk carries the prompt and cached
token counts (so a caller that stops early still counts them), the final one
the whole usage, ``finish_reason``, the engine-side TTFT and the worker id. The
port is bound without ``SO_REUSEPORT``: a second worker on a used port fails to
start instead of sharing its traffic. With a token (``--grpc-token-file``) an
interceptor refuses every call whose metadata lacks ``authorization: Bearer
<token>`` with ``UNAUTHENTICATED`` before any servicer code runs.
Bad input answers ``INVALID_ARGUMENT`` and leaves the engine untouched; a
client that cancels the call aborts the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.grpc_auth import METADATA_KEY, is_bearer
from contract.prompt_wire import prompt_ids
from worker.engine.sequence import SamplingParams
from worker.engine.types import EngineError
from worker.serve.grpc_mux import GenerateManyMixin

logger = logging.getLogger(__name__)

# A caller may ask for fewer, larger messages; past this many tokens a message
# only delays the client (and a stop string's detection) for no CPU saved.
MAX_STREAM_INTERVAL = 64


def sampling_from_proto(
    msg: pb.SamplingParams, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """Maps the wire message to ``SamplingParams`` (proto3 zeros mean "not set").

    ``max_tokens`` 0 means "up to the context length"; ``top_p`` 0 means off.
    """
    max_tokens = msg.max_tokens or max(1, max_model_len - prompt_len)
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) or 1.0,
        min_p=float(msg.min_p),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        json_schema=msg.json_schema or None,
        grammar=msg.grammar or None,
    )


class WorkerService(GenerateManyMixin, worker_pb2_grpc.WorkerServicer):
    """Serves one engine over gRPC: ``Generate`` per call, or many on one ``GenerateMany``."""

    def __init__(self, engine: Any, *, worker_id: str, stall_s: float = 10.0) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.stall_s = stall_s  # Health says not serving past this long without a step

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt = prompt_ids(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {exc}")
        try:
            params = sampling_from_proto(request.sampling, len(prompt), self.engine.max_model_len)
            params.validate(self.engine.vocab_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        stream: Any = None
        finished = started = False
        try:
            stream = self.engine.generate(
                request_id,
                prompt,
                params,
                cache_salt=request.cache_salt,
                lora=request.lora_name,
                stream_interval=min(request.stream_interval, MAX_STREAM_INTERVAL),
            )
            async for out in stream:
                chunk = pb.GenerateResponse(
                    token_ids=out.new_token_ids, finished=out.finished, worker_id=self.worker_id
                )
                for lp in out.new_logprobs:
                    chunk.logprobs.add(
                        logprob=lp.logprob,
                        top_ids=[t for t, _ in lp.top],
                        top_logprobs=[v for _, v in lp.top],
                    )
                if not started:
                    # Prompt and cached tokens go out with the first chunk, so a caller
                    # that stops early (stop string, client gone) still counts its hits.
                    chunk.usage.prompt_tokens = out.prompt_tokens
                    chunk.usage.cached_tokens = out.cached_tokens
                started = True
                if out.finished:
                    finished = True
                    chunk.finish_reason = out.finish_reason or "stop"
                    chunk.usage.prompt_tokens = out.prompt_tokens
                    chunk.usage.completion_tokens = out.completion_tokens
                    chunk.usage.cached_tokens = out.cached_tokens
                    chunk.ttft_s = out.ttft_s or 0.0
                yield chunk
                if finished:
                    return
        except ValueError as exc:
            if started:
                raise
            logger.info("request %s rejected: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineError as exc:
            logger.error("request %s failed: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except RuntimeError as exc:  # the engine is shutting down: another worker can serve it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            # Cancellation (client gone, deadline) lands here: free the blocks now.
            if not finished:
                if stream is not None:
                    await _close(stream)
                self.engine.abort(request_id)

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        problem = self.engine.health(self.stall_s)
        if problem is not None:
            logger.warning("health: %s", problem)
        stats = self.engine.stats()
        return pb.HealthResponse(
            serving=problem is None,
            running=int(stats.running),
            waiting=int(stats.waiting),
            free_blocks=int(stats.free_blocks),
        )


async def _close(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await asyncio.shield(aclose())
    except (RuntimeError, ValueError, asyncio.CancelledError) as exc:
        logger.debug("closing a generate stream: %r", exc)


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without ``authorization: Bearer <token>`` (``UNAUTHENTICATED``)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("--grpc-token-file: the token is empty")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        # Every value is checked (no early exit): a call with several is no faster to refuse.
        given = [v for k, v in metadata if k == METADATA_KEY and isinstance(v, str)]
        if handler is None or any([is_bearer(v, self._token) for v in given]):
            return handler
        logger.warning(
            "refused %s: %s", handler_call_details.method, "wrong token" if given else "no token"
        )
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only answers UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong token (metadata authorization: Bearer <token>)",
        )

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


async def start_grpc_server(
    service: WorkerService,
    host: str,
    port: int,
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    token: str = "",
) -> tuple[grpc.aio.Server, int]:
    """Starts a ``grpc.aio`` server for ``service``; returns it and the bound port.

    With ``token`` every call must carry it as ``authorization: Bearer <token>``.
    """
    server = grpc.aio.server(
        interceptors=[TokenInterceptor(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 0),  # a second server on this port must fail, not share it
        ],
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls_cert is not None and tls_key is not None:
            creds = grpc.ssl_server_credentials([(tls_key.read_bytes(), tls_cert.read_bytes())])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's "Failed to bind": the port is taken
        raise OSError(f"--grpc-port: cannot bind {address} (in use?)") from exc
    if bound == 0:
        raise OSError(f"--grpc-port: cannot bind {address}")
    await server.start()
    return server, bound
