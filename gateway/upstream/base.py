"""The seam between the dispatcher and a worker, whatever its transport.

A worker is reached over gRPC (kvroute's engine) or OpenAI HTTP (vLLM); the
registry record says which. Either way the gateway sends the token ids it
computed and reads back ``Chunk``s of new token ids, so routing, retries and
the relay to the client never look at a transport. Transport failures become
``UpstreamError``: ``retryable`` failures before the first token send the
request to the next worker; after it they end the stream in-band.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from openai_api.errors import APIError
from openai_api.logprobs import TokenLogprobs


@dataclass(slots=True)  # not frozen, as ``Chunk``: built and copied per request
class Generation:
    """What one worker is asked to do: continue ``prompt_ids`` under these options (treat as
    read-only)."""

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    cache_salt: str
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: off; k: each token's logprob and the top k
    json_schema: str | None = None  # response_format: the JSON schema the output follows
    grammar: str | None = None  # a forced tool call: the Lark grammar the output follows
    stream_interval: int = 0  # tokens per worker message after the first (0: the worker's)


# Not frozen: one is built per worker message (129 for a 128-token stream), and a
# frozen dataclass's __init__ costs 3.3x as much (0.67 against 0.20 us).
@dataclass(slots=True)
class Chunk:
    """New token ids from the worker; the last one has ``finished`` set (treat as read-only)."""

    token_ids: Sequence[int]
    finished: bool = False
    finish_reason: str = ""
    cached_tokens: int | None = None  # prompt tokens the worker served from cache, once known
    logprobs: Sequence[TokenLogprobs] = ()  # one per token id, when the generation asked


class UpstreamError(Exception):
    """A transport failure; ``api_error`` is what the client sees if nothing else can serve."""

    def __init__(self, message: str, *, retryable: bool, api_error: APIError) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.api_error = api_error


class UpstreamCall(Protocol):
    """One running generation on one worker."""

    async def read(self) -> Chunk | None:
        """The next chunk, or None at the end of the stream; raises ``UpstreamError``."""
        ...

    async def read_within(self, limit_s: float) -> Chunk | None:
        """``read``, or ``TimeoutError`` when nothing arrives within ``limit_s``.

        A timeout leaves the call as it was: a later read gets what arrives.
        """
        ...

    def cancel(self) -> None:
        """Ends the call; a running generation is aborted on the worker."""
        ...


class PatientRead:
    """``read_within`` for a call whose pending read cannot be interrupted without ending
    the call (a gRPC read cancelled by a timeout cancels its RPC): the read runs as a
    task that a timeout leaves running, and the next ``within`` waits on it again."""

    def __init__(self, read: Callable[[], Awaitable[Chunk | None]]) -> None:
        self._read = read
        self._task: asyncio.Future[Chunk | None] | None = None

    async def within(self, limit_s: float) -> Chunk | None:
        task = self._task
        if task is None:
            task = self._task = asyncio.ensure_future(self._read())
            # A read that fails after its call gave up on it is not an unhandled error.
            task.add_done_callback(_mark_retrieved)
        done, _ = await asyncio.wait((task,), timeout=limit_s)
        if not done:
            raise TimeoutError
        self._task = None
        return task.result()

    def cancel(self) -> None:
        """Drops a read still pending (its call is being cancelled); a call that cancels
        itself from inside that read lets the read end with its own error."""
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()


def _mark_retrieved(task: asyncio.Future[Chunk | None]) -> None:
    if not task.cancelled():
        task.exception()


class Upstream(Protocol):
    """Starts generations on the workers of one transport."""

    def start(
        self,
        worker_id: str,
        address: str,
        generation: Generation,
        timeout_s: float,
        *,
        frames_address: str = "",
        prompt_encoding: str = "",
    ) -> UpstreamCall: ...

    def connect(self, worker_id: str, address: str, *, frames_address: str = "") -> None:
        """Opens what a first request to a worker that just joined would wait for."""
        ...

    def forget(self, worker_id: str) -> None: ...

    async def close(self) -> None: ...
