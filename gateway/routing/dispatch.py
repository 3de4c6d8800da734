"""From token ids to a running generation on the best worker.

The read path, in order:

1. Candidates: workers in the registry mirror, minus those that just failed.
2. Hashes: the prompt's block chain under each candidate's hash spec plus the
   tenant's salt (one chain per distinct spec; usually one).
3. Lookup: the index's longest cached prefix per worker (speculative included).
4. Score: ``Router.choose`` on a ``WorkerState`` per candidate.
5. Send: the gRPC ``Generate`` call to the chosen worker; if it fails before
   its first token, the next worker in ``Decision.ranked`` gets it.

The registry's load numbers lag a heartbeat, so each worker's running/waiting
is reduced by the requests this gateway saw finish since that heartbeat.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from contract import worker_pb2
from contract.hashing import HashSpec
from gateway.edge.auth import Tenant
from gateway.edge.errors import APIError
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.window_stats import RequestRecord, RollingStats
from gateway.routing.index import BlockIndex
from gateway.routing.mirror import IndexMirror, WorkerEntry
from gateway.routing.router import Decision, Router, RouteRequest, WorkerState
from gateway.routing.sessions import SessionMap
from gateway.text.prefix_tokens import Prompt
from gateway.upstream.grpc_worker import WorkerClients

logger = logging.getLogger(__name__)

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}
_FAILED_COOLDOWN_S = 2.0  # a worker that refused a call is skipped this long
_FINISH_MEMORY_S = 30.0


@dataclass(frozen=True)
class Job:
    """One generation request, tokenized and ready to route."""

    request_id: str
    prompt: Prompt
    sampling: worker_pb2.SamplingParams
    tenant: Tenant
    session_key: str | None
    started: float  # perf_counter() when the HTTP request arrived

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids


@dataclass
class Load:
    """What this gateway itself has in flight on one worker."""

    inflight: int = 0
    pending: int = 0  # sent, no first token yet
    pending_prefill_tokens: int = 0
    finished_at: deque[float] = field(default_factory=deque)  # wall clock, for lag correction


class Stream:
    """A generation that produced its first response on ``worker_id``."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        job: Job,
        worker_id: str,
        reason: str,
        predicted_cached: int,
        call: grpc.aio.UnaryStreamCall,
        first: worker_pb2.GenerateResponse,
    ) -> None:
        self._d = dispatcher
        self.job = job
        self.worker_id = worker_id
        self.reason = reason
        self.predicted_cached_tokens = predicted_cached
        self.first = first
        self._call = call
        self._closed = False

    async def next(self) -> worker_pb2.GenerateResponse | None:
        """The next response, or None at the end of the stream."""
        msg = await self._call.read()
        if msg is grpc.aio.EOF:
            return None
        return msg  # type: ignore[no-any-return]

    def close(self, cached_tokens: int | None) -> None:
        """Ends the call (aborting it on the worker if still running) and records the outcome."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        self._d.finished(self, cached_tokens)


class Dispatcher:
    """Routes jobs and opens their gRPC streams."""

    def __init__(
        self,
        *,
        mirror: IndexMirror,
        index: BlockIndex,
        router: Router,
        clients: WorkerClients,
        sessions: SessionMap,
        metrics: GatewayMetrics,
        stats: RollingStats,
        speculative_ttl_s: float,
        max_queue_per_worker: int,
        request_timeout_s: float,
        max_retries: int,
    ) -> None:
        self.mirror = mirror
        self.index = index
        self.router = router
        self.clients = clients
        self.sessions = sessions
        self.metrics = metrics
        self.stats = stats
        self.speculative_ttl_s = speculative_ttl_s
        self.max_queue_per_worker = max_queue_per_worker
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.loads: dict[str, Load] = {}
        self._down_until: dict[str, float] = {}

    # -- candidates and load ------------------------------------------------------

    def healthy(self) -> list[WorkerEntry]:
        """Workers to route to: registered, and not failing right now."""
        now = time.monotonic()
        return [
            e
            for wid, e in sorted(self.mirror.workers.items())
            if self._down_until.get(wid, 0.0) <= now
        ]

    def max_model_len(self, default: int) -> int:
        """The smallest context any healthy worker accepts (``default`` if none says)."""
        lens = [e.record.max_model_len for e in self.healthy() if e.record.max_model_len > 0]
        return min(lens) if lens else default

    def state(self, entry: WorkerEntry, cached_blocks: int) -> WorkerState:
        """The router's view of ``entry``, corrected for finishes since its heartbeat."""
        rec = entry.record
        load = self.loads.get(rec.worker_id) or Load()
        done = sum(1 for t in load.finished_at if t > rec.updated_at)
        waiting = max(0, rec.waiting - done)
        running = max(0, rec.running - max(0, done - rec.waiting))
        queued = rec.queued_prefill_tokens if running + waiting else 0
        return WorkerState(
            worker_id=rec.worker_id,
            cached_blocks=cached_blocks,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=max(queued, load.pending_prefill_tokens),
            prefill_tokens_per_s=rec.prefill_tokens_per_s,
            free_blocks=rec.free_blocks,
            num_blocks=rec.num_blocks,
            inflight=load.inflight,
        )

    # -- routing ---------------------------------------------------------------------

    def route(self, job: Job) -> tuple[Decision, dict[str, list[int]], list[WorkerState]]:
        """Steps 1-4: the decision, each candidate's chain, and the states scored."""
        candidates = self.healthy()
        if not candidates:
            raise APIError(
                503,
                "no healthy worker is available",
                code="no_workers",
                headers={"Retry-After": "1"},
            )
        chains: dict[HashSpec, list[int]] = {}
        hashes_of: dict[str, list[int]] = {}
        for e in candidates:
            if e.spec is None:
                hashes_of[e.record.worker_id] = []
                continue
            spec = e.spec.with_salt(job.tenant.cache_salt)
            if spec not in chains:
                chains[spec] = job.prompt.block_hashes(spec)
            hashes_of[e.record.worker_id] = chains[spec]
        now = time.monotonic()
        cached: dict[str, int] = {}
        for chain in {id(c): c for c in chains.values()}.values():
            for wid, n in self.index.longest_prefix(chain, now).items():
                if hashes_of.get(wid) is chain:
                    cached[wid] = n
        states = [self.state(e, cached.get(e.record.worker_id, 0)) for e in candidates]
        if self.max_queue_per_worker > 0 and all(
            max(s.waiting, self.loads.get(s.worker_id, Load()).pending) >= self.max_queue_per_worker
            for s in states
        ):
            raise APIError(
                429,
                "every worker's queue is full; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        block_size = candidates[0].spec.block_size if candidates[0].spec else 16
        request = RouteRequest(
            prompt_tokens=len(job.prompt_ids),
            block_size=block_size,
            session_worker=self.sessions.get(job.session_key, now),
        )
        return self.router.choose(request, states), hashes_of, states

    # -- sending ---------------------------------------------------------------------

    async def open(self, job: Job) -> Stream:
        """Routes ``job`` and returns its stream once a worker produced a first response."""
        decision, hashes_of, states = self.route(job)
        self.metrics.routing_seconds.observe(time.perf_counter() - job.started)
        by_id = {s.worker_id: s for s in states}
        deadline = time.monotonic() + self.request_timeout_s
        last_error: grpc.aio.AioRpcError | None = None
        for attempt, wid in enumerate(decision.ranked[: 1 + self.max_retries]):
            entry = self.mirror.workers.get(wid)
            if entry is None:
                continue
            reason = decision.reason if attempt == 0 else "fallback"
            predicted = min(
                by_id[wid].cached_blocks * (entry.spec.block_size if entry.spec else 16),
                len(job.prompt_ids),
            )
            now = time.monotonic()
            self.index.speculate(wid, hashes_of.get(wid, []), now, self.speculative_ttl_s)
            self.sessions.put(job.session_key, wid, now)
            load = self.loads.setdefault(wid, Load())
            uncached = len(job.prompt_ids) - predicted
            load.inflight += 1
            load.pending += 1
            load.pending_prefill_tokens += uncached
            request = worker_pb2.GenerateRequest(
                request_id=job.request_id if attempt == 0 else f"{job.request_id}-{attempt}",
                prompt_token_ids=job.prompt_ids,
                sampling=job.sampling,
                cache_salt=job.tenant.cache_salt,
            )
            stub = self.clients.stub(wid, entry.record.address)
            call = stub.Generate(request, timeout=max(0.001, deadline - now))
            try:
                first = await self._first(call)
            except grpc.aio.AioRpcError as exc:
                load.inflight -= 1
                if exc.code() not in _RETRYABLE:
                    raise _api_error(exc) from exc
                logger.warning(
                    "request %s: worker %s failed before its first token (%s: %s)",
                    job.request_id,
                    wid,
                    exc.code().name,
                    exc.details(),
                )
                self._down_until[wid] = time.monotonic() + _FAILED_COOLDOWN_S
                self.metrics.retries.labels(wid).inc()
                last_error = exc
                continue
            except BaseException:
                call.cancel()
                load.inflight -= 1
                raise
            finally:
                load.pending -= 1
                load.pending_prefill_tokens -= uncached
            self.metrics.requests.labels(wid, reason).inc()
            self.metrics.prompt_tokens.labels(wid).inc(len(job.prompt_ids))
            self.metrics.predicted_cached_tokens.labels(wid).inc(predicted)
            self.metrics.ttft_seconds.labels(wid).observe(time.perf_counter() - job.started)
            logger.debug(
                "request %s -> worker %s (%s, %d/%d tokens cached)",
                job.request_id,
                wid,
                reason,
                predicted,
                len(job.prompt_ids),
            )
            return Stream(self, job, wid, reason, predicted, call, first)
        detail = f": {last_error.details()}" if last_error is not None else ""
        raise APIError(
            503,
            f"no worker could serve the request{detail}",
            code="no_workers",
            headers={"Retry-After": "1"},
        )

    @staticmethod
    async def _first(call: grpc.aio.UnaryStreamCall) -> worker_pb2.GenerateResponse:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "stream ended without a token",
                )
            if msg.token_ids or msg.finished:
                return msg  # type: ignore[no-any-return]

    def finished(self, stream: Stream, cached_tokens: int | None) -> None:
        """Bookkeeping when a stream ends (called once, by ``Stream.close``)."""
        wid = stream.worker_id
        load = self.loads.setdefault(wid, Load())
        load.inflight = max(0, load.inflight - 1)
        wall = time.time()
        load.finished_at.append(wall)
        while load.finished_at and wall - load.finished_at[0] > _FINISH_MEMORY_S:
            load.finished_at.popleft()
        self.metrics.e2e_seconds.labels(wid).observe(time.perf_counter() - stream.job.started)
        if cached_tokens is not None:
            self.metrics.cached_tokens.labels(wid).inc(cached_tokens)
        self.stats.add(
            RequestRecord(
                at=time.monotonic(),
                worker_id=wid,
                reason=stream.reason,
                prompt_tokens=len(stream.job.prompt_ids),
                predicted_cached_tokens=stream.predicted_cached_tokens,
                cached_tokens=cached_tokens or 0,
            )
        )

    def forget(self, worker_id: str) -> None:
        """Drops per-worker state of a worker that left the registry."""
        self.loads.pop(worker_id, None)
        self._down_until.pop(worker_id, None)


def _api_error(exc: grpc.aio.AioRpcError) -> APIError:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request timed out", code="timeout")
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        return APIError(
            400, f"the worker rejected the request: {exc.details()}", code="invalid_request"
        )
    return APIError(502, f"worker error {code.name}: {exc.details()}", code="worker_error")
