"""What flows through routing: a tokenized ``Job``, its ``Candidates``, the open ``Stream``.

The request path builds a ``Job``, the dispatcher turns it into ``Candidates``
(the workers it may go to, each with its block chain) and, once a worker
produced the first token, a ``Stream`` the relay reads until the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gateway.edge.auth import Tenant
from gateway.routing.mirror_state import WorkerEntry
from gateway.text.prefix_tokens import Prompt
from gateway.upstream.base import Chunk, Generation, UpstreamCall, UpstreamError
from openai_api.errors import APIError

# Auto stream interval: one more token per worker message for every this many
# streams the gateway relays, up to MAX_AUTO_INTERVAL. Relaying costs CPU per
# message (a gRPC read, a detokenizer push, an SSE write), not per token.
STREAMS_PER_STEP = 8
MAX_AUTO_INTERVAL = 8
# Tokens per worker message for an answer the client reads whole (``Job.whole_answer``):
# the gateway only collects them, so messages between the first and the last are
# overhead (a chat of 8 tokens: 2 messages instead of 8). Bounded so a worker
# decoding at a token a second still speaks well inside the inter-token timeout.
WHOLE_ANSWER_INTERVAL = 16

if TYPE_CHECKING:
    from gateway.routing.dispatch import Dispatcher

# The dispatcher's log: a stream's warnings keep the name they always had.
logger = logging.getLogger("gateway.routing.dispatch")


@dataclass(frozen=True)
class Job:
    """One generation request, tokenized and ready to route."""

    request_id: str
    prompt: Prompt
    generation: Generation
    tenant: Tenant
    session_key: str | None
    started: float  # perf_counter() when the HTTP request arrived
    # False when the client left max_tokens unset: each worker fills its own context.
    max_tokens_fixed: bool = True
    # The client reads the answer whole (no stream) and nothing is looked for in the
    # text as it comes (no stop string, no tool call): larger worker messages do.
    whole_answer: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    def for_worker(self, max_model_len: int, attempt: int, stream_interval: int) -> Generation:
        """The generation as sent to one worker, on the ``attempt``-th try (0 = first)."""
        g = self.generation
        changes: dict[str, Any] = {}
        if not self.max_tokens_fixed and max_model_len > 0:
            # Unset max_tokens: what this worker's context leaves after the prompt.
            changes["max_tokens"] = min(g.max_tokens, max_model_len - len(self.prompt_ids))
        if attempt:
            changes["request_id"] = f"{g.request_id}-{attempt}"
        if stream_interval != g.stream_interval:
            changes["stream_interval"] = stream_interval
        return replace(g, **changes) if changes else g


@dataclass(frozen=True)
class Candidates:
    """The workers a job may go to, and the chain each would look up."""

    entries: list[WorkerEntry]
    chains: Mapping[str, list[int]]  # worker id -> block hashes under its spec and salt
    distinct: list[list[int]]  # the non-empty chains of ``chains``, each once (usually one)


class Stream:
    """A generation that produced its first chunk on ``worker_id``."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        job: Job,
        worker_id: str,
        reason: str,
        predicted_cached: int,
        call: UpstreamCall,
        first: Chunk,
    ) -> None:
        self._d = dispatcher
        self.job = job
        self.worker_id = worker_id
        self.reason = reason
        self.predicted_cached_tokens = predicted_cached
        self.first = first
        self.first_at = time.perf_counter()  # the first token's arrival (TTFT in the access log)
        self._call = call
        self._closed = False

    async def next(self) -> Chunk | None:
        """The next chunk, or None at the end of the stream; raises ``UpstreamError``.

        A worker silent for the inter-token timeout (hung, stopped, cut off)
        ends the stream with a 504 instead of holding the client forever.
        """
        limit = self._d.inter_token_timeout_s
        try:
            return await self._call.read_within(limit)
        except TimeoutError:
            self._call.cancel()
            logger.warning(
                "request %s: worker %s sent nothing for %.1fs; ending the stream",
                self.job.request_id,
                self.worker_id,
                limit,
            )
            raise UpstreamError(
                f"no token within the inter-token timeout ({limit:g}s)",
                retryable=False,
                api_error=APIError(504, "the worker stopped producing tokens", code="timeout"),
            ) from None

    def close(self, cached_tokens: int | None) -> None:
        """Ends the call (aborting it on the worker if still running) and records the outcome."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        self._d.finished(self, cached_tokens)


def stream_interval(fixed: int, open_streams: int, whole_answer: bool = False) -> int:
    """Tokens per worker message for the next request (``--stream-interval``; 0 = auto).

    Auto keeps token-by-token streaming while the gateway is lightly loaded
    and, as it relays more streams, asks workers for fewer, larger messages:
    1 up to 15 open streams, 2 from 16, ... 8 from 64. An answer the client
    reads whole takes at least ``WHOLE_ANSWER_INTERVAL``. The first token
    always goes at once, so TTFT does not change.
    """
    interval = (
        fixed if fixed > 0 else max(1, min(MAX_AUTO_INTERVAL, open_streams // STREAMS_PER_STEP))
    )
    return max(interval, WHOLE_ANSWER_INTERVAL) if whole_answer else interval
