"""From a tokenized job to a running generation on the best worker.

The request path (``gateway.request_path``) calls these steps in order:

- ``candidates``: workers in the registry mirror, minus those that just failed,
  whose record is malformed or whose engine stalled (``record_check``).
- ``hash``: the workers whose context fits the job, and the prompt's block
  chain under each one's hash spec plus the tenant's salt (one chain per
  distinct spec; usually one).
- ``look_up``: the index's longest cached prefix per worker (speculative included).
- ``choose``: ``Router.choose`` over each candidate's corrected load.
- ``open``: the upstream call to the chosen worker; if it fails (or stays
  silent past the first-token timeout) before its first token, the next
  worker in ``Decision.ranked`` gets it. After the first token, a worker
  silent past the inter-token timeout ends the stream with an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, KeysView, Mapping

import numpy as np

from contract.hashing import HashSpec
from contract.redis_layout import WorkerRecord
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.window_stats import RequestRecord, RollingStats
from gateway.routing.columns import FleetColumns
from gateway.routing.index import BlockIndex
from gateway.routing.index_share import RemoteIndex
from gateway.routing.jobs import Candidates, Job, Stream, stream_interval
from gateway.routing.load import LoadBook, router_rows
from gateway.routing.mirror import IndexMirror
from gateway.routing.mirror_state import WorkerEntry
from gateway.routing.prefix_demand import PrefixDemand
from gateway.routing.record_check import RecordCheck
from gateway.routing.replicas import ReplicaSync
from gateway.routing.router import (
    ROW_FIELDS,
    SMALL_FLEET,
    Decision,
    Router,
    RouteRequest,
    Row,
    WorkerState,
)
from gateway.routing.sessions import SessionMap
from gateway.upstream.base import Chunk, Upstream, UpstreamCall, UpstreamError
from openai_api.errors import APIError

logger = logging.getLogger(__name__)

_FAILED_COOLDOWN_S = 2.0  # a worker that refused a call is skipped this long
_WATCH_S = 0.25  # how often a request waiting for its first token checks on its worker
DEFAULT_TRANSPORT = "grpc"
_NEVER = float("inf")
_WAITING = ROW_FIELDS.index("waiting")
_PENDING = ROW_FIELDS.index("pending")


class Dispatcher:
    """Routes jobs and opens their upstream streams."""

    def __init__(
        self,
        *,
        mirror: IndexMirror,
        index: BlockIndex | RemoteIndex,
        router: Router,
        upstreams: dict[str, Upstream],
        sessions: SessionMap,
        metrics: GatewayMetrics,
        stats: RollingStats,
        speculative_ttl_s: float,
        max_queue_per_worker: int,
        request_timeout_s: float,
        max_retries: int,
        first_token_timeout_s: float = 60.0,
        inter_token_timeout_s: float = 30.0,
        record_check: RecordCheck | None = None,
        stream_interval: int = 0,
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
        self.stream_interval = stream_interval  # 0 = by how many streams are open
        self.open_streams = 0  # requests this gateway has in flight, on any worker
        self.first_token_timeout_s = first_token_timeout_s
        self.inter_token_timeout_s = inter_token_timeout_s
        self.record_check = record_check or RecordCheck(metrics.registry, stall_s=5.0)
        self.loads = LoadBook()
        self._columns = FleetColumns(self.loads)
        self._no_peers_touched: set[str] = set()
        self.prefix_demand = PrefixDemand()
        self._down_until: dict[str, float] = {}
        self._cooldowns = 0  # changes to _down_until, for healthy()'s reuse
        self._healthy: list[WorkerEntry] = []
        self._healthy_key: tuple[int, int, int] | None = None
        self._healthy_until = _NEVER
        self._lens_of: list[WorkerEntry] | None = None  # the healthy list _max_len is of
        self._groups_of: list[WorkerEntry] | None = None  # the list _grouped is of
        self._grouped: list[tuple[HashSpec | None, int, list[str]]] = []
        self._group_of: list[int] = []  # per entry of that list, its group
        self._group_keys: dict[str, None] = {}  # the one group's workers, when there is one
        self._max_len = 0
        # Set by the app when replicas share routing (``gateway.routing.replicas``).
        self.replicas: ReplicaSync | None = None

    # -- candidates and load ------------------------------------------------------

    def healthy(self) -> list[WorkerEntry]:
        """Workers to route to: registered, sane records, engine stepping, not failing now.

        When every otherwise usable worker reports a stalled engine (a loaded CPU
        fleet, one slow step each), they are all kept: a slow fleet still beats a 503.

        The list is reused until a record, a worker or a cooldown changes (a request
        asks up to three times, and at 1,000 workers a pass over the records costs
        ~0.3 ms): callers must not modify it.
        """
        now = time.monotonic()
        mirror = self.mirror
        key = (mirror.changes, len(mirror.workers), self._cooldowns)
        if key == self._healthy_key and now < self._healthy_until:
            return self._healthy
        up = [
            (e, self.record_check.problem(e.record))
            for wid, e in sorted(mirror.workers.items())
            if self._down_until.get(wid, 0.0) <= now
        ]
        ok = [e for e, problem in up if problem is None]
        if not ok:
            ok = [e for e, problem in up if problem == "engine_stalled"]
        # A cooling-down worker comes back when its cooldown ends.
        self._healthy_until = min((t for t in self._down_until.values() if t > now), default=_NEVER)
        self._healthy_key, self._healthy = key, ok
        return ok

    def max_model_len(self, default: int) -> int:
        """The largest context a healthy worker accepts (``default`` if none says).

        Per worker, ``hash`` keeps only the workers a job fits, so one small
        worker never shrinks what the fleet accepts.
        """
        healthy = self.healthy()
        if healthy is not self._lens_of:  # worked out once per healthy list
            self._lens_of = healthy
            self._max_len = max((e.record.max_model_len for e in healthy), default=0)
        return self._max_len if self._max_len > 0 else default

    def fits(self, job: Job, entry: WorkerEntry) -> bool:
        """Whether ``entry``'s context holds the prompt (and ``max_tokens`` when the client set it)."""
        limit = entry.record.max_model_len
        # Unknown (<= 0): the gateway's own limit was checked already.
        return limit <= 0 or _context_needed(job) <= limit

    def state(self, entry: WorkerEntry, cached_blocks: int) -> WorkerState:
        """The router's view of ``entry``: its heartbeat, corrected by this gateway's own view."""
        return WorkerState(entry.record.worker_id, *self._row(entry, cached_blocks))

    def _row(self, entry: WorkerEntry, cached_blocks: int) -> Row:
        """``state`` as a ``router.ROW_FIELDS`` row (no object per worker)."""
        return self._rows([entry], {entry.record.worker_id: cached_blocks})[1][0]

    def _rows(
        self, entries: list[WorkerEntry], cached: dict[str, int]
    ) -> tuple[list[str], list[Row]]:
        peers = self.replicas.peer_loads() if self.replicas is not None else {}
        return router_rows(entries, self.loads, cached, self.index.block_count, peers)

    # -- routing: candidates -> hash -> look up -> choose ---------------------------

    def candidates(self) -> list[WorkerEntry]:
        """Healthy workers, or 503 when there is none."""
        entries = self.healthy()
        if not entries:
            raise APIError(
                503,
                "no healthy worker is available: " + self.mirror.no_worker_hint(),
                code="no_workers",
                headers={"Retry-After": "1"},
            )
        return entries

    def hash(self, job: Job, entries: list[WorkerEntry]) -> Candidates:
        """Each fitting candidate's block chain of the prompt (once per distinct spec)."""
        groups = self._groups(entries)
        need = _context_needed(job)
        fit = [limit <= 0 or need <= limit for _, limit, _ in groups]
        if not any(fit):
            raise APIError(
                400,
                f"the prompt ({len(job.prompt_ids)} tokens) + max_tokens "
                f"({job.generation.max_tokens}) fits no worker's context",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if not all(fit):
            entries = [e for e, g in zip(entries, self._group_of, strict=True) if fit[g]]
        # Workers usually share one spec: the prompt is hashed once per distinct spec
        # (and salt), and the workers of a group get their chains in one C call.
        salt = job.tenant.cache_salt
        one_spec = groups[0][0]
        if len(groups) == 1 and one_spec is not None:  # one spec and one limit: the usual
            hashes = job.prompt.block_hashes(one_spec.with_salt(salt))
            same = SameChain(self._group_keys, hashes)
            return Candidates(entries, same, [hashes] if hashes else [])
        by_spec: dict[HashSpec, list[int]] = {}
        chains: dict[str, list[int]] = {}
        for (spec, _, wids), ok in zip(groups, fit, strict=True):
            if not ok:
                continue
            chain: list[int] = []
            if spec is not None:
                salted = spec.with_salt(salt)
                if salted not in by_spec:
                    by_spec[salted] = job.prompt.block_hashes(salted)
                chain = by_spec[salted]
            chains.update(dict.fromkeys(wids, chain))
        return Candidates(entries, chains, [c for c in by_spec.values() if c])

    def _groups(self, entries: list[WorkerEntry]) -> list[tuple[HashSpec | None, int, list[str]]]:
        """``entries`` grouped by (hash spec, context limit): what ``hash`` does per worker
        is the same within a group. Worked out once per healthy list (at 1,000 workers a
        pass over the entries per request was ~0.4 ms)."""
        if entries is self._groups_of:
            return self._grouped
        keys: dict[tuple[HashSpec | None, int], int] = {}
        grouped: list[tuple[HashSpec | None, int, list[str]]] = []
        group_of: list[int] = []
        for e in entries:
            key = (e.spec, e.record.max_model_len)
            g = keys.get(key)
            if g is None:
                g = keys[key] = len(grouped)
                grouped.append((e.spec, e.record.max_model_len, []))
            grouped[g][2].append(e.record.worker_id)
            group_of.append(g)
        self._groups_of, self._grouped, self._group_of = entries, grouped, group_of
        self._group_keys = dict.fromkeys(grouped[0][2]) if len(grouped) == 1 else {}
        return grouped

    def look_up(self, cands: Candidates) -> dict[str, int]:
        """Per worker, the leading blocks of its chain the index says it holds."""
        index = self.index
        assert isinstance(index, BlockIndex), "a front process looks up with alook_up"
        now = time.monotonic()
        return _held(cands, [(c, index.longest_prefix(c, now)) for c in cands.distinct])

    async def alook_up(self, cands: Candidates) -> dict[str, int]:
        """``look_up``, asking the gateway's index owner when this process is a front."""
        index = self.index
        if isinstance(index, BlockIndex):
            return self.look_up(cands)
        return _held(cands, [(c, await index.longest_prefix(c)) for c in cands.distinct])

    def choose(self, job: Job, cands: Candidates, cached: dict[str, int]) -> Decision:
        """The router's pick (and ranked fallbacks); 429 when every queue is full."""
        ids, rows, matrix = self._router_view(cands, cached)
        if self._queues_full(rows, matrix):
            raise APIError(
                429,
                "every worker's queue is full; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        first = cands.entries[0].spec
        now = time.monotonic()
        request = RouteRequest(
            prompt_tokens=len(job.prompt_ids),
            block_size=first.block_size if first else 16,
            session_worker=self.sessions.get(job.session_key, now),
            prefix_demand=self._demand(cands, cached, now),
        )
        if self.replicas is not None:
            self.router.replica_rank, self.router.replica_count = self.replicas.rank()
        if matrix is not None:
            return self.router.choose_columns(request, ids, matrix)
        return self.router.choose_rows(request, ids, rows)

    def _queues_full(self, rows: list[Row], matrix: np.ndarray | None) -> bool:
        """Whether every candidate queues ``--max-queue-per-worker`` requests (never when
        the bound is off: the default, so no request pays for the check)."""
        limit = self.max_queue_per_worker
        if limit <= 0:
            return False
        if matrix is not None:
            return bool((matrix[:, [_WAITING, _PENDING]].max(axis=1) >= limit).all())
        return all(max(row[_WAITING], row[_PENDING]) >= limit for row in rows)

    def _router_view(
        self, cands: Candidates, cached: dict[str, int]
    ) -> tuple[list[str], list[Row], np.ndarray | None]:
        """The candidates' ids and rows: a large fleet's as one matrix kept between
        requests (``gateway.routing.columns``), a small one's built per request."""
        sync = self.replicas
        peers_touched = sync.touched if sync is not None else self._no_peers_touched
        kvroute = self.router.config.policy == "kvroute"
        if len(cands.entries) > SMALL_FLEET and kvroute:
            found = self._columns.rows(
                self.healthy(),
                cands.entries,
                cached,
                self.index.block_counts,
                sync.peer_loads() if sync is not None else {},
                peers_touched,
            )
            if found is not None:
                return found[0], [], found[1]
        ids, rows = self._rows(cands.entries, cached)
        if len(self.healthy()) <= SMALL_FLEET or not kvroute:
            self._columns.unused(peers_touched)  # a small fleet: no marks to keep
        return ids, rows, None

    def _demand(self, cands: Candidates, cached: dict[str, int], now: float) -> float:
        """How many requests lately wanted this one's longest cached prefix (it included)."""
        deepest = _deepest_block(cands, cached)
        return 1.0 if deepest is None else self.prefix_demand.observe(deepest, now)

    # -- sending ---------------------------------------------------------------------

    async def open(
        self,
        job: Job,
        cands: Candidates,
        cached: dict[str, int],
        decision: Decision,
        on_sent: Callable[[], None] | None = None,
    ) -> Stream:
        """Sends ``job`` down ``decision.ranked`` until a worker produces a first chunk.

        ``on_sent`` is called once, as soon as the first attempt's request is on its
        way: work that must not delay the request (the client's headers) goes there.
        """
        self.metrics.routing_seconds.observe(time.perf_counter() - job.started)
        deadline = time.monotonic() + self.request_timeout_s
        last_error: UpstreamError | None = None
        tried: list[str] = []
        for attempt in range(1 + self.max_retries):
            picked = self._next_worker(job, decision.ranked, tried)
            if picked is None:
                break
            wid, entry = picked
            tried.append(wid)
            reason = decision.reason if attempt == 0 else "retry"
            block_size = entry.spec.block_size if entry.spec else 16
            predicted = min(cached.get(wid, 0) * block_size, len(job.prompt_ids))
            now = time.monotonic()
            chain = cands.chains.get(wid, [])
            # Held while the request waits for its first token: a queued request's
            # blocks are stored only when its prefill runs (a 2 s guess let the
            # siblings of a request queued longer scatter on a saturated fleet).
            # Blocks the worker really holds need no claim.
            held = self.index.real_depth(wid, chain) if chain else 0
            claim = chain[held:] if held else chain
            self.index.speculate(wid, claim, now, self._hold_s())
            self.sessions.put(job.session_key, wid, now)
            load = self.loads.of(wid)
            uncached = len(job.prompt_ids) - predicted
            load.inflight += 1
            self.open_streams += 1
            load.pending += 1
            load.pending_prefill_tokens += uncached
            if self.replicas is not None:
                # The other replicas mirror the same real blocks: they get the claim.
                self.replicas.routed(
                    wid, claim, job.session_key, self._hold_s(), _deepest_block(cands, cached)
                )
            interval = stream_interval(self.stream_interval, self.open_streams, job.whole_answer)
            generation = job.for_worker(entry.record.max_model_len, attempt, interval)
            upstream = self.upstreams[getattr(entry.record, "transport", "") or DEFAULT_TRANSPORT]
            call = upstream.start(
                wid,
                entry.record.address,
                generation,
                max(0.001, deadline - now),
                frames_address=entry.record.frames_address,
                prompt_encoding=entry.record.prompt_encoding,
            )
            if on_sent is not None:
                on_sent()
                on_sent = None
            first: Chunk | None = None
            try:
                first = await self._first_chunk(wid, call)
            except UpstreamError as exc:
                load.inflight -= 1
                self.open_streams -= 1
                if not exc.retryable:
                    raise exc.api_error from exc
                logger.warning(
                    "request %s: worker %s failed before its first token (%s)",
                    job.request_id,
                    wid,
                    exc.message,
                )
                self._down_until[wid] = time.monotonic() + _FAILED_COOLDOWN_S
                self._cooldowns += 1
                self.metrics.retries.labels(wid).inc()
                last_error = exc
                continue
            except BaseException:
                call.cancel()
                load.inflight -= 1
                self.open_streams -= 1
                raise
            finally:
                self.loads.touched.add(wid)
                load.pending -= 1
                load.pending_prefill_tokens -= uncached
                self._settle(wid, claim, served=first is not None)
                if self.replicas is not None:
                    self.replicas.load_changed(wid)
            series = self.metrics.worker(wid)
            series.requests(reason).inc()
            series.prompt_tokens.inc(len(job.prompt_ids))
            series.predicted_cached_tokens.inc(predicted)
            series.ttft_seconds.observe(time.perf_counter() - job.started)
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

    def _hold_s(self) -> float:
        """How long a routed chain stays speculative at most: until its first token
        (which the first-token timeout bounds), then the grace. 0: speculation off."""
        if self.speculative_ttl_s <= 0:
            return 0.0
        return self.first_token_timeout_s + self.speculative_ttl_s

    def _settle(self, wid: str, claim: list[int], *, served: bool) -> None:
        """Ends the hold on ``claim`` (the blocks of the chain that were held only
        speculatively): the prompt is in the worker's cache (its events land within
        the grace), or the worker failed it and holds nothing for it."""
        if not claim or self.speculative_ttl_s <= 0:
            return
        if served:
            self.index.speculate(wid, claim, time.monotonic(), self.speculative_ttl_s)
        else:
            self.index.withdraw(wid, claim)
        if self.replicas is not None:
            self.replicas.settled(wid, claim, self.speculative_ttl_s if served else 0.0)

    def _left(self, entry: WorkerEntry) -> bool:
        """Whether ``entry`` stopped being routable (a stalled engine only while others step)."""
        problem = self.record_check.problem(entry.record)
        if problem is None:
            return False
        if problem != "engine_stalled":
            return True
        return any(
            self.record_check.problem(e.record) is None for e in self.mirror.workers.values()
        )

    def _next_worker(
        self, job: Job, ranked: tuple[str, ...], tried: list[str]
    ) -> tuple[str, WorkerEntry] | None:
        """The next worker to try: the router's ranking, then any healthy worker that
        joined since (a request queued through a rolling restart outlives its ranking)."""
        for wid in ranked:
            entry = self.mirror.workers.get(wid)
            if wid not in tried and entry is not None:
                return wid, entry
        fresh = [
            e
            for e in self.healthy()
            if e.record.worker_id not in tried
            and e.record.worker_id not in ranked
            and self.fits(job, e)
        ]
        if not fresh:
            return None
        load = self.loads.get
        best = min(fresh, key=lambda e: getattr(load(e.record.worker_id), "inflight", 0))
        return best.record.worker_id, best

    def finished(self, stream: Stream, cached_tokens: int | None) -> None:
        """Bookkeeping when a stream ends (called once, by ``Stream.close``)."""
        wid = stream.worker_id
        load = self.loads.of(wid)
        load.inflight = max(0, load.inflight - 1)
        self.open_streams = max(0, self.open_streams - 1)
        load.finished += 1
        if self.replicas is not None:
            self.replicas.finished(wid)
        series = self.metrics.worker(wid)
        series.e2e_seconds.observe(time.perf_counter() - stream.job.started)
        if cached_tokens is not None:
            series.cached_tokens.inc(cached_tokens)
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

    def connect(self, worker_id: str, record: WorkerRecord) -> None:
        """Connects ahead of time to a worker that joined the registry."""
        upstream = self.upstreams.get(record.transport or DEFAULT_TRANSPORT)
        if upstream is not None:
            upstream.connect(worker_id, record.address, frames_address=record.frames_address)

    def forget(self, worker_id: str) -> None:
        """Drops per-worker state of a worker that left the registry.

        Calls still streaming from it keep running (a draining worker finishes
        them); each upstream closes its connection once they are done.
        """
        self.record_check.forget(worker_id)
        if self.loads.pop(worker_id, None) is not None and self.replicas is not None:
            self.replicas.load_changed(worker_id)  # the others drop its counts too
        self._down_until.pop(worker_id, None)
        self._cooldowns += 1
        for upstream in self.upstreams.values():
            upstream.forget(worker_id)

    async def _first_chunk(self, wid: str, call: UpstreamCall) -> Chunk:
        """The call's first chunk with a token (or its end). Given up, retryably, when
        the worker leaves or stalls, at the first-token timeout, or when the stream
        ends before a token.

        A request queued on a worker that deregistered (drain), whose heartbeat
        lapsed (SIGSTOP, crash) or whose engine stalled has no token yet, so
        another worker can take it at once instead of after a timeout.
        """
        limit = self.first_token_timeout_s
        give_up = time.monotonic() + limit
        while True:
            try:
                chunk = await call.read_within(_WATCH_S)
            except TimeoutError:
                entry = self.mirror.workers.get(wid)
                gone = entry is None or self._left(entry)
                if gone or time.monotonic() >= give_up:
                    call.cancel()
                    why = "the worker left or stalled" if gone else f"none within {limit:g}s"
                    raise UpstreamError(
                        f"no first token: {why}",
                        retryable=True,
                        api_error=APIError(
                            504, "no worker produced a first token in time", code="timeout"
                        ),
                    ) from None
                continue
            if chunk is None:
                raise UpstreamError(
                    "stream ended without a token",
                    retryable=True,
                    api_error=APIError(
                        502, "the worker ended the stream early", code="worker_error"
                    ),
                )
            if chunk.token_ids or chunk.finished:
                return chunk


class SameChain(Mapping[str, list[int]]):
    """Every worker of ``workers`` -> one ``chain``: a fleet of one hash spec gets its
    ``Candidates.chains`` without a dict built per request (37 us at 1,000 workers)."""

    __slots__ = ("_chain", "_workers")

    def __init__(self, workers: dict[str, None], chain: list[int]) -> None:
        self._workers, self._chain = workers, chain

    def __getitem__(self, worker_id: str) -> list[int]:
        if worker_id in self._workers:
            return self._chain
        raise KeyError(worker_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def keys(self) -> KeysView[str]:
        return self._workers.keys()


def _context_needed(job: Job) -> int:
    """Context tokens ``job`` takes: its prompt and ``max_tokens`` when the client set it."""
    return len(job.prompt_ids) + (job.generation.max_tokens if job.max_tokens_fixed else 1)


def _held(cands: Candidates, found: list[tuple[list[int], dict[str, int]]]) -> dict[str, int]:
    """Per worker, its cached blocks from the look-up of its own chain."""
    chains = cands.chains
    if len(found) == 1 and found[0][1].keys() <= chains.keys():
        # One chain (one spec; a worker without one holds no block) and every holder a
        # candidate: the usual case, as it came from the index.
        return found[0][1]
    cached: dict[str, int] = {}
    for chain, holders in found:
        for wid, n in holders.items():
            if chains.get(wid) is chain:
                cached[wid] = n
    return cached


def _deepest_block(cands: Candidates, cached: dict[str, int]) -> int | None:
    """The last block of the longest cached prefix any candidate holds (None: none)."""
    if not cached:
        return None
    if isinstance(cands.chains, SameChain):  # one chain: only the depth matters (C speed)
        n, chain = max(cached.values()), cands.distinct[0] if cands.distinct else None
    else:
        wid = max(cached, key=cached.__getitem__)
        n, chain = cached[wid], cands.chains.get(wid)
    if n <= 0 or not chain or n > len(chain):
        return None
    return chain[n - 1]
