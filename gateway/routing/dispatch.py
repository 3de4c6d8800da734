"""From a tokenized job to a running generation on the best worker.

The request path (``gateway.request_path``) calls these steps in order:

- ``candidates``: workers in the registry mirror, minus those that just failed.
- ``hash``: the prompt's block chain under each candidate's hash spec plus the
  tenant's salt (one chain per distinct spec; usually one).
- ``look_up``: the index's longest cached prefix per worker (speculative included).
- ``choose``: ``Router.choose`` over each candidate's corrected load.
- ``open``: the upstream call to the chosen worker; if it fails before its
  first token, the next worker in ``Decision.ranked`` gets it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from contract.hashing import HashSpec
from gateway.edge.auth import Tenant
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.window_stats import RequestRecord, RollingStats
from gateway.routing.index import BlockIndex
from gateway.routing.load import GatewayLoad, corrected_load
from gateway.routing.mirror import IndexMirror, WorkerEntry
from gateway.routing.router import Decision, Router, RouteRequest, WorkerState
from gateway.routing.sessions import SessionMap
from gateway.text.prefix_tokens import Prompt
from gateway.upstream.base import Chunk, Generation, Upstream, UpstreamCall, UpstreamError
from openai_api.errors import APIError

logger = logging.getLogger(__name__)

_FAILED_COOLDOWN_S = 2.0  # a worker that refused a call is skipped this long
DEFAULT_TRANSPORT = "grpc"


@dataclass(frozen=True)
class Job:
    """One generation request, tokenized and ready to route."""

    request_id: str
    prompt: Prompt
    generation: Generation
    tenant: Tenant
    session_key: str | None
    started: float  # perf_counter() when the HTTP request arrived

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids


@dataclass(frozen=True)
class Candidates:
    """The workers a job may go to, and the chain each would look up."""

    entries: list[WorkerEntry]
    chains: dict[str, list[int]]  # worker id -> block hashes under its spec and salt


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
        self._call = call
        self._closed = False

    async def next(self) -> Chunk | None:
        """The next chunk, or None at the end of the stream; raises ``UpstreamError``."""
        return await self._call.read()

    def close(self, cached_tokens: int | None) -> None:
        """Ends the call (aborting it on the worker if still running) and records the outcome."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        self._d.finished(self, cached_tokens)


class Dispatcher:
    """Routes jobs and opens their upstream streams."""

    def __init__(
        self,
        *,
        mirror: IndexMirror,
        index: BlockIndex,
        router: Router,
        upstreams: dict[str, Upstream],
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
        self.upstreams = upstreams
        self.sessions = sessions
        self.metrics = metrics
        self.stats = stats
        self.speculative_ttl_s = speculative_ttl_s
        self.max_queue_per_worker = max_queue_per_worker
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.loads: dict[str, GatewayLoad] = {}
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
        """The router's view of ``entry``: its heartbeat, corrected by this gateway's own view."""
        rec = entry.record
        load = self.loads.setdefault(rec.worker_id, GatewayLoad())
        load.saw_record(rec.updated_at)
        running, waiting, queued = corrected_load(
            rec.running,
            rec.waiting,
            rec.queued_prefill_tokens,
            load.finished_since_heartbeat,
            load.pending_prefill_tokens,
        )
        return WorkerState(
            worker_id=rec.worker_id,
            cached_blocks=cached_blocks,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rec.prefill_tokens_per_s,
            inflight=load.inflight,
        )

    # -- routing: candidates -> hash -> look up -> choose ---------------------------

    def candidates(self) -> list[WorkerEntry]:
        """Healthy workers, or 503 when there is none."""
        entries = self.healthy()
        if not entries:
            raise APIError(
                503,
                "no healthy worker is available",
                code="no_workers",
                headers={"Retry-After": "1"},
            )
        return entries

    def hash(self, job: Job, entries: list[WorkerEntry]) -> Candidates:
        """Each candidate's block chain of the prompt (computed once per distinct spec)."""
        by_spec: dict[HashSpec, list[int]] = {}
        chains: dict[str, list[int]] = {}
        for e in entries:
            if e.spec is None:
                chains[e.record.worker_id] = []
                continue
            spec = e.spec.with_salt(job.tenant.cache_salt)
            if spec not in by_spec:
                by_spec[spec] = job.prompt.block_hashes(spec)
            chains[e.record.worker_id] = by_spec[spec]
        return Candidates(entries, chains)

    def look_up(self, cands: Candidates) -> dict[str, int]:
        """Per worker, the leading blocks of its chain the index says it holds."""
        now = time.monotonic()
        cached: dict[str, int] = {}
        distinct = {id(c): c for c in cands.chains.values() if c}
        for chain in distinct.values():
            for wid, n in self.index.longest_prefix(chain, now).items():
                if cands.chains.get(wid) is chain:
                    cached[wid] = n
        return cached

    def choose(self, job: Job, cands: Candidates, cached: dict[str, int]) -> Decision:
        """The router's pick (and ranked fallbacks); 429 when every queue is full."""
        states = [self.state(e, cached.get(e.record.worker_id, 0)) for e in cands.entries]
        if self.max_queue_per_worker > 0 and all(
            max(s.waiting, self.loads[s.worker_id].pending) >= self.max_queue_per_worker
            for s in states
        ):
            raise APIError(
                429,
                "every worker's queue is full; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        first = cands.entries[0].spec
        request = RouteRequest(
            prompt_tokens=len(job.prompt_ids),
            block_size=first.block_size if first else 16,
            session_worker=self.sessions.get(job.session_key, time.monotonic()),
        )
        return self.router.choose(request, states)

    # -- sending ---------------------------------------------------------------------

    async def open(
        self, job: Job, cands: Candidates, cached: dict[str, int], decision: Decision
    ) -> Stream:
        """Sends ``job`` down ``decision.ranked`` until a worker produces a first chunk."""
        self.metrics.routing_seconds.observe(time.perf_counter() - job.started)
        deadline = time.monotonic() + self.request_timeout_s
        last_error: UpstreamError | None = None
        for attempt, wid in enumerate(decision.ranked[: 1 + self.max_retries]):
            entry = self.mirror.workers.get(wid)
            if entry is None:
                continue
            reason = decision.reason if attempt == 0 else "retry"
            block_size = entry.spec.block_size if entry.spec else 16
            predicted = min(cached.get(wid, 0) * block_size, len(job.prompt_ids))
            now = time.monotonic()
            self.index.speculate(wid, cands.chains.get(wid, []), now, self.speculative_ttl_s)
            self.sessions.put(job.session_key, wid, now)
            load = self.loads.setdefault(wid, GatewayLoad())
            uncached = len(job.prompt_ids) - predicted
            load.inflight += 1
            load.pending += 1
            load.pending_prefill_tokens += uncached
            generation = job.generation
            if attempt:
                generation = _retry_of(generation, attempt)
            upstream = self.upstreams[getattr(entry.record, "transport", "") or DEFAULT_TRANSPORT]
            call = upstream.start(wid, entry.record.address, generation, max(0.001, deadline - now))
            try:
                first = await _first_chunk(call)
            except UpstreamError as exc:
                load.inflight -= 1
                if not exc.retryable:
                    raise exc.api_error from exc
                logger.warning(
                    "request %s: worker %s failed before its first token (%s)",
                    job.request_id,
                    wid,
                    exc.message,
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
        detail = f": {last_error.message}" if last_error is not None else ""
        raise APIError(
            503,
            f"no worker could serve the request{detail}",
            code="no_workers",
            headers={"Retry-After": "1"},
        )

    def finished(self, stream: Stream, cached_tokens: int | None) -> None:
        """Bookkeeping when a stream ends (called once, by ``Stream.close``)."""
        wid = stream.worker_id
        load = self.loads.setdefault(wid, GatewayLoad())
        load.inflight = max(0, load.inflight - 1)
        load.finished += 1
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
        for upstream in self.upstreams.values():
            upstream.forget(worker_id)


def _retry_of(g: Generation, attempt: int) -> Generation:
    from dataclasses import replace

    return replace(g, request_id=f"{g.request_id}-{attempt}")


async def _first_chunk(call: UpstreamCall) -> Chunk:
    """Reads until the worker produced a token (or finished); EOF before that is retryable."""
    while True:
        chunk = await call.read()
        if chunk is None:
            raise UpstreamError(
                "stream ended without a token",
                retryable=True,
                api_error=APIError(502, "the worker ended the stream early", code="worker_error"),
            )
        if chunk.token_ids or chunk.finished:
            return chunk
