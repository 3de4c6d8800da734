"""The routing decision: which worker a request should go to, and why.

Pure: no I/O, no clocks, no Redis. The gateway (and the loadtest fleet
simulator) hand in a snapshot of every candidate worker — its cached prefix
for this request and its load — and get back a ``Decision``. The only state
kept between calls is the round-robin cursor and a seeded random generator,
so a run is reproducible.

The ``kvroute`` policy, step by step:

1. Load of a worker = outstanding requests, ``max(running + waiting, inflight)``
   (the registry's count is shared by all gateways but lags a heartbeat; this
   gateway's ``inflight`` is exact but only its own; the larger is the safer).
2. Bounded load, judged by the queue (work a worker has not started), not by
   how many requests it runs: a worker is skipped, unless every worker would
   be, when it has both more queued requests and more queued prefill time than
   the fleet allows: ``balance_factor`` x the fleet's mean, and at least
   ``QUEUE_SLACK`` requests / ``WORK_SLACK_S`` seconds above it. A hot prefix
   then spills to a second worker, which caches it too. Both must hold: a
   queue of cache hits drains in milliseconds (spilling it would duplicate the
   prefix for nothing), and one long prefill is already priced by the score.
   Running (decoding) requests do not count: a worker's batch takes them
   without delaying a new prefill much, and counting them pushed
   conversations off their cache on many-worker fleets at low load. On fleets
   of N < 4 workers the factor is capped at ``max(1.5, N / 2)``.
3. Score per remaining worker: the predicted time to first token,
   ``(queued_prefill_tokens + uncached_tokens + (recompute_weight - 1) *
   pressure * share * duplicate_tokens) / prefill_rate + max(running, inflight) *
   decode_weight_s`` (a worker that has not measured its ``prefill_rate`` yet is
   assumed the median of the others', ``typical_prefill_rate``), where
   ``duplicate_tokens`` are the prompt tokens another
   worker already holds but this one would recompute. With
   ``recompute_weight`` 1 this is exactly this request's TTFT; above 1 it also
   charges what a duplicate costs the fleet: the recompute delays every
   request queued behind it and evicts other prefixes to make room. Without
   it, a short transient queue on the worker holding a 10k-token prefix sends
   the request to a cold worker. ``pressure`` (0..1) scales that charge by
   how full this worker's cache is compared with the holder's:
   ``1 - max(0, holder_fill - fill)``. When the holder's cache is full and
   this worker's is empty, duplicating evicts nothing while piling more onto
   the holder evicts live prefixes there, so only the TTFT counts; with
   equally full caches (the steady state) or unknown capacities the full
   charge applies. Without it a shared system prompt pins every new
   conversation to the first worker that cached it, while the rest of the
   fleet's cache sits empty. ``share`` (0..1) is the fraction of the prompt
   the longest cached prefix covers: a 32-token match on a 900-token prompt
   protects little (the request evicts its 868 new tokens wherever it goes),
   a 10k-token match on a 10.1k-token prompt is worth keeping together. Without
   it, requests sharing only a short prefix piled onto that prefix's holders
   (the 500-request Mooncake replay of ``bench_peers`` on 16 emulated workers:
   hit rate 0.131 over four runs, 0.148 over five with it; sglang-router 0.157). Tokens
   no worker holds cost the same everywhere and are not weighted. ``share`` is
   divided by the square root of the prefix's ``demand``: how many requests
   lately wanted that same longest cached prefix (``RouteRequest.prefix_demand``).
   A conversation's own history is wanted by its next turn only (demand 1, the
   full charge); a system prompt every new user sends is wanted by all of them,
   and once a second worker holds it each later request can use either, so
   one duplicate's cost is spread over many requests. Without it a shared
   system prompt kept new conversations on its first holders until their
   caches were fuller than an empty one (sweep: 74 -> 75 of 80 cells, every
   ``chat`` and ``bursty`` cell's hit margin up; a linear division instead of
   the square root: 64, duplicating hot Zipf prefixes everywhere). The fill gap
   also counts more for such a prefix: ``pressure = max(0, 1 - gain * gap)`` with
   ``gain = 1 + (shared_fill_gain - 1) * (1 - 1 / demand)``, so a system prompt
   is free to duplicate once its holder is a third fuller than an empty cache,
   before the holder evicts, while a conversation's own history keeps the plain
   gap. Without it new conversations stayed on the system prompt's first holder
   until its cache was full and then lost their history to its evictions (the
   sweep's chat with tight caches at its base rate: TTFT p99 0.063 s against
   ``session``'s 0.013 s on 4 workers, 0.014 s with it).
   docs/ROUTING.md has the sweep behind each rule.
4. Workers within ``TIE_RELATIVE`` (plus ``TIE_ABSOLUTE_S``) of the best score are tied: the
   session's last worker wins a tie, then, when the longest cached prefix is at least
   half the prompt and no other request lately wanted it (the conversation's own
   history), the workers holding it: a gateway that restarted, or a replica that
   never saw the session, keeps the conversation where its history is instead of
   sending it to an empty cache, where every small prompt predicts within
   ``TIE_ABSOLUTE_S`` of any other. Then the emptiest cache (fills within
   ``FILL_TIE`` are equal; a request that evicts nothing there costs the
   fleet nothing), then the least loaded, then rotation. Without the fill
   step, cold requests while caches fill went by load alone and piled onto
   a few workers, whose caches then evicted what the idle ones could have
   kept (the 500-request Mooncake replay of ``bench_peers``: 0.131 hit rate
   against ``sglang_like``'s 0.147 in the simulator with 16,384-token caches;
   0.154 with it). Gateway replicas first narrow a tie to their own share of
   the fleet (``replica_rank``, ``replica_count``: every ``count``-th worker in
   id order from the rank, when that share holds a tied worker): a burst of
   requests reaches every replica in the same few milliseconds, before any
   hears what the others routed, and each would break its ties the same way
   onto the same emptiest worker. The simulator's Mooncake replay on 16
   workers (``bench_peers``' shape): three replicas' mean TTFT 1.47x one
   gateway's without the shares, 1.00x with them; the sweep with
   ``--replicas 3``: docs/ROUTING.md.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

POLICIES = ("kvroute", "round_robin", "random", "least_loaded", "session", "prefix")
REASONS = ("cache", "session", "load", "fallback", "retry")

# Predictions this close (relative) are noise in the measured prefill rates,
# not a real difference: let affinity and load decide instead.
TIE_RELATIVE = 0.05
# ... and so are predictions this close in seconds: a worker 4 ms faster only
# because it holds a 32-token prefix of an 850-token prompt is not a reason to
# send it every such request (the Mooncake replay's common first blocks piled
# a fifth of all requests onto one worker). Sweep: 69 -> 72 of 80 cells at
# seed 0, 70 -> 71 at seed 1 (0.005: 71, 0.01: 69, 0.03: 71, 0.05: 67).
TIE_ABSOLUTE_S = 0.02
# How far above the fleet's mean queue a worker may be before the bound applies
# (step 2): queued requests, and seconds of queued prefill.
QUEUE_SLACK = 2
WORK_SLACK_S = 2.0
# Cache fills this close are the same for a tie-break (step 4): index counts lag events.
FILL_TIE = 0.02
# A prediction is never below this many tokens of work: the worker always
# computes the last prompt token, even when every block is cached.
_MIN_UNCACHED_TOKENS = 1
# Fleets up to this size are scored in plain Python: numpy's per-call overhead
# (~45 array operations a request) costs more than the arithmetic below it
# (bench: ``python -m loadtest.bench_router_paths``).
SMALL_FLEET = 32


# Not frozen: the gateway builds one per worker per request, and a frozen
# dataclass's __init__ (object.__setattr__ per field) costs 2.7x as much.
@dataclass(slots=True)
class WorkerState:
    """One candidate worker as the router sees it for one request (treat as read-only)."""

    worker_id: str
    cached_blocks: int  # longest run of the request's chain on this worker, from block 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # 0 = unknown: the fleet's typical rate is assumed
    inflight: int = 0  # requests this gateway sent and that have not finished
    pending: int = 0  # requests this gateway sent that have no first token yet
    held_blocks: int = 0  # blocks the index believes this worker holds (any request's)
    capacity_blocks: int = 0  # the worker's KV blocks (0 = unknown)

    @property
    def cache_fill(self) -> float | None:
        """Fraction of the worker's cache in use (None when its capacity is unknown)."""
        if self.capacity_blocks <= 0:
            return None
        return min(self.held_blocks / self.capacity_blocks, 1.0)


# The WorkerState fields step 2-4 read, in the column order ``_kvroute`` unpacks: every
# field after ``worker_id``, in order, so a row is ``WorkerState(worker_id, *row)``.
ROW_FIELDS = (
    "cached_blocks",
    "running",
    "waiting",
    "queued_prefill_tokens",
    "prefill_tokens_per_s",
    "inflight",
    "pending",
    "held_blocks",
    "capacity_blocks",
)
_COLUMNS = attrgetter(*ROW_FIELDS)
Row = tuple[int, int, int, int, float, int, int, int, int]


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs to know about the request itself."""

    prompt_tokens: int
    block_size: int
    session_worker: str | None = None  # the worker this session last used, if any
    # Requests that lately wanted the same longest cached prefix, this one included
    # (``gateway.routing.prefix_demand``; 1 = only this one): step 3's ``demand``.
    prefix_demand: float = 1.0


@dataclass(frozen=True)
class Decision:
    """The chosen worker, why, and the fallbacks in order."""

    worker_id: str
    # "cache" | "session" | "load" | "fallback" (no signal told workers apart); the
    # dispatcher reports "retry" when a later worker of ``ranked`` served the request.
    reason: str
    predicted_cached_tokens: int
    ranked: tuple[str, ...]  # every candidate, best first (for retries)


@dataclass(frozen=True)
class RouterConfig:
    """Routing policy and its knobs."""

    policy: str = "kvroute"  # kvroute|round_robin|random|least_loaded|session|prefix
    balance_factor: float = 2.0  # bounded load: skip workers above factor x mean load
    default_prefill_tokens_per_s: float = 5000.0  # when no candidate has measured its rate
    decode_weight_s: float = 0.01
    recompute_weight: float = 12.0  # fleet cost of a duplicated token relative to a queued one
    # How much faster the duplicate charge of a prefix many requests want falls with the
    # fill gap (step 3's ``gain``): 1 = as fast as for one conversation's own prefix.
    shared_fill_gain: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if not self.balance_factor >= 1.0:
            raise ValueError(f"--balance-factor must be >= 1.0, got {self.balance_factor}")
        if not self.default_prefill_tokens_per_s > 0:
            raise ValueError("default_prefill_tokens_per_s must be positive")
        if self.decode_weight_s < 0:
            raise ValueError("decode_weight_s must be >= 0")
        if not self.recompute_weight >= 1.0:
            raise ValueError(f"--recompute-weight must be >= 1.0, got {self.recompute_weight}")
        if not self.shared_fill_gain >= 1.0:
            raise ValueError(f"--shared-fill-gain must be >= 1.0, got {self.shared_fill_gain}")


def typical_prefill_rate(rates: Sequence[float], default: float) -> float:
    """The prefill rate assumed for a worker that has not measured its own yet: the
    median of the rates the other candidates measured, ``default`` if none has.

    A fixed default instead made every untried worker look slower (or faster) than
    the ones already working: on 16 emulated H100 workers (about 9k tokens/s measured,
    5k assumed) the first three workers to prefill took every cold request of the
    shared-prefix workload for the whole run, 13 workers never got one, and hits
    queued behind those cold prefills (TTFT p99 above round robin's).
    """
    known = sorted(r for r in rates if r > 0)
    if not known:
        return default
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def with_typical_rates(rates: list[float], default: float) -> list[float]:
    """``rates`` with every unmeasured one (0) replaced by ``typical_prefill_rate``."""
    if all(r > 0 for r in rates):
        return rates
    typical = typical_prefill_rate(rates, default)
    return [r if r > 0 else typical for r in rates]


def worker_load(w: WorkerState) -> int:
    """Outstanding requests on ``w`` (see step 1 of the module docstring)."""
    return max(w.running + w.waiting, w.inflight)


def worker_queue(w: WorkerState) -> int:
    """Requests on ``w`` that have not started producing tokens."""
    return max(w.waiting, w.pending)


class Router:
    """Picks a worker per request under one policy."""

    def __init__(self, config: RouterConfig, *, rotation_start: int = 0) -> None:
        self.config = config
        # Gateway replicas start their rotations at different places: with the same
        # start, replicas that see the same fleet break the same ties the same way and
        # send simultaneous cold requests to one worker.
        self._cursor = rotation_start
        self._rng = random.Random(config.seed)
        # This gateway's rank among the live replicas, and their number (step 4); the
        # dispatcher sets them from ``gateway.routing.replicas.ReplicaSync.rank``.
        self.replica_rank, self.replica_count = 0, 1

    # -- public ---------------------------------------------------------------

    def choose_rows(self, request: RouteRequest, ids: list[str], rows: list[Row]) -> Decision:
        """``choose`` over workers given as ids and ``ROW_FIELDS`` rows (``WorkerState``
        without its objects: a large fleet's rows go to numpy as they are).

        ``ids`` sorted, as ``choose`` sorts its workers; the same decision as
        ``choose([WorkerState(i, *r) ...])``.
        """
        if self.config.policy != "kvroute" or len(ids) <= SMALL_FLEET:
            return self.choose(
                request, [WorkerState(i, *r) for i, r in zip(ids, rows, strict=True)]
            )
        if request.block_size <= 0:
            raise ValueError("block_size must be positive")
        if any(a > b for a, b in itertools.pairwise(ids)):
            order = sorted(range(len(ids)), key=ids.__getitem__)
            ids, rows = [ids[i] for i in order], [rows[i] for i in order]
        flat = itertools.chain.from_iterable(rows)  # fromiter: 0.8x np.array's time on 1,000 rows
        cols = np.fromiter(flat, dtype=np.float64, count=len(rows) * len(ROW_FIELDS))
        return self._kvroute_columns(request, ids, cols)

    def choose_columns(self, request: RouteRequest, ids: list[str], cols: np.ndarray) -> Decision:
        """``choose_rows`` over rows already in one float matrix, a row per worker
        (``gateway.routing.columns``): the ``kvroute`` policy over more than
        ``SMALL_FLEET`` workers, ``ids`` sorted."""
        if self.config.policy != "kvroute" or len(ids) <= SMALL_FLEET:
            raise ValueError("choose_columns takes a kvroute fleet larger than SMALL_FLEET")
        if request.block_size <= 0:
            raise ValueError("block_size must be positive")
        return self._kvroute_columns(request, ids, cols)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        """The worker for ``request`` among ``workers``; ``ValueError`` if there are none."""
        if not workers:
            raise ValueError("no workers to route to")
        if request.block_size <= 0:
            raise ValueError("block_size must be positive")
        # Sorted by id so that rotation and ties do not depend on the caller's order.
        ws = sorted(workers, key=lambda w: w.worker_id)
        policy = self.config.policy
        if policy == "kvroute":
            if len(ws) <= SMALL_FLEET:
                return self._kvroute_small(request, ws)
            return self._kvroute(request, ws)
        if policy == "round_robin":
            start = self._cursor % len(ws)
            self._cursor += 1
            order = ws[start:] + ws[:start]
            return self._decide(request, order, "fallback")
        if policy == "random":
            order = list(ws)
            self._rng.shuffle(order)
            return self._decide(request, order, "fallback")
        if policy == "least_loaded":
            return self._decide(request, self._by_load(ws), "load")
        if policy == "session":
            order = self._by_load(ws)
            for i, w in enumerate(order):
                if w.worker_id == request.session_worker:
                    return self._decide(request, [w, *order[:i], *order[i + 1 :]], "session")
            return self._decide(request, order, "load")
        # prefix: longest match only, ties least loaded
        order = sorted(self._by_load(ws), key=lambda w: -w.cached_blocks)
        return self._decide(request, order, "cache" if order[0].cached_blocks > 0 else "load")

    def predicted_ttft(
        self, request: RouteRequest, w: WorkerState, typical_rate: float | None = None
    ) -> float:
        """Seconds until ``w`` would emit this request's first token.

        ``typical_rate`` is the rate assumed if ``w`` has none (``typical_prefill_rate``
        of the fleet; None: the configured default).
        """
        return self._cost(request, w, 0, 1.0, typical_rate)

    def score(
        self,
        request: RouteRequest,
        w: WorkerState,
        fleet_cached_tokens: int,
        holder_fill: float | None = None,
        typical_rate: float | None = None,
    ) -> float:
        """The ranking cost of sending the request to ``w`` (step 3): lower is better.

        ``fleet_cached_tokens`` is the longest cached prefix on any candidate,
        ``holder_fill`` the cache fill of the worker holding it (None: unknown) and
        ``typical_rate`` as for ``predicted_ttft``.
        """
        pressure = 1.0
        fill = w.cache_fill
        if holder_fill is not None and fill is not None:
            pressure = max(0.0, 1.0 - self._fill_gain(request) * max(0.0, holder_fill - fill))
        weight = 1.0 + (self.config.recompute_weight - 1.0) * pressure * self._share(
            request, fleet_cached_tokens
        )
        return self._cost(request, w, fleet_cached_tokens, weight, typical_rate)

    def _cost(
        self,
        request: RouteRequest,
        w: WorkerState,
        fleet_cached_tokens: int,
        recompute_weight: float,
        typical_rate: float | None,
    ) -> float:
        cached = self._cached_tokens(request, w)
        uncached = max(request.prompt_tokens - cached, _MIN_UNCACHED_TOKENS)
        duplicate = max(fleet_cached_tokens - cached, 0)
        work = w.queued_prefill_tokens + uncached + (recompute_weight - 1.0) * duplicate
        rate = w.prefill_tokens_per_s or typical_rate or self.config.default_prefill_tokens_per_s
        return work / rate + max(w.running, w.inflight) * self.config.decode_weight_s

    def _fill_gain(self, request: RouteRequest) -> float:
        """How many times the fill gap counts in ``pressure`` (step 3): 1 for a prefix only
        this request wants, up to ``shared_fill_gain`` for one many requests want."""
        demand = max(request.prefix_demand, 1.0)
        return 1.0 + (self.config.shared_fill_gain - 1.0) * (1.0 - 1.0 / demand)

    @staticmethod
    def _keeps_history(request: RouteRequest, fleet_cached_tokens: float) -> bool:
        """Whether a tie goes to the holder of the longest cached prefix before the emptiest
        cache (step 4): when that prefix is most of the prompt and only this request wants
        it, i.e. the conversation's own history, as a session would keep it."""
        return request.prefix_demand <= 1.0 and 2 * fleet_cached_tokens >= request.prompt_tokens

    @staticmethod
    def _share(request: RouteRequest, fleet_cached_tokens: float) -> float:
        """The fraction of the prompt that the longest cached prefix covers, over the
        square root of the prefix's demand (step 3)."""
        share = min(fleet_cached_tokens / max(request.prompt_tokens, 1), 1.0)
        if request.prefix_demand > 1.0:
            share /= math.sqrt(request.prefix_demand)
        return share

    # -- internals ------------------------------------------------------------

    def _kvroute(self, request: RouteRequest, ws: list[WorkerState]) -> Decision:
        rows = np.array(list(map(_COLUMNS, ws)), dtype=np.float64)
        return self._kvroute_columns(request, [w.worker_id for w in ws], rows)

    def _kvroute_columns(self, request: RouteRequest, ids: list[str], rows: np.ndarray) -> Decision:
        # Steps 2-4 over columns (numpy): a 1,000-worker fleet whose every worker
        # holds the system prompt is scored in well under a millisecond. The
        # arithmetic is ``score``'s, in the same order, so the costs are equal bit
        # for bit (tests/gateway/test_router.py checks it on random fleets).
        n, cfg = len(ids), self.config
        cols = rows.reshape(n, len(ROW_FIELDS))
        blocks, running, waiting, queued, rate, inflight, pending, held, capacity = cols.T
        if not (rate > 0).all():  # rare once running: a worker that has not prefilled yet
            rate = np.array(with_typical_rates(rate.tolist(), cfg.default_prefill_tokens_per_s))
        load = np.maximum(running + waiting, inflight)
        over = self._over(np.maximum(waiting, pending), queued / rate)
        cached = np.minimum(blocks * request.block_size, request.prompt_tokens)
        fleet_cached = float(cached.max())
        known = capacity > 0
        fill = np.minimum(held / np.where(known, capacity, 1.0), 1.0)
        pressure = np.ones(n)
        holders = known & (cached == fleet_cached)
        if fleet_cached > 0 and holders.any():
            holder_fill = fill[holders].min()
            gap = self._fill_gain(request) * np.maximum(0.0, holder_fill - fill)
            pressure = np.where(known, np.maximum(0.0, 1.0 - gap), 1.0)
        weight = 1.0 + (cfg.recompute_weight - 1.0) * pressure * self._share(request, fleet_cached)
        uncached = np.maximum(request.prompt_tokens - cached, _MIN_UNCACHED_TOKENS)
        duplicate = np.maximum(fleet_cached - cached, 0.0)
        work = queued + uncached + (weight - 1.0) * duplicate
        cost = work / rate + np.maximum(running, inflight) * cfg.decode_weight_s
        best = cost[~over].min()
        tied = np.flatnonzero(~over & (cost <= best * (1 + TIE_RELATIVE) + TIE_ABSOLUTE_S))
        session = None
        if request.session_worker is not None:
            with contextlib.suppress(ValueError):  # not a candidate
                at = ids.index(request.session_worker)
                session = at if bool((tied == at).any()) else None
        if session is not None and len(tied) > 1:
            chosen, reason = session, "session"
        else:
            if self._keeps_history(request, fleet_cached):
                holding = tied[cached[tied] == fleet_cached]
                tied = holding if len(holding) else tied
            chosen = self._least_loaded_rotating(tied, fill, known, load)
            if blocks[chosen] > 0:
                reason = "cache"
            elif n > 1 and (len(tied) == 1 or len(set(load[tied].tolist())) > 1):
                reason = "load"  # queues and running work decided
            else:
                reason = "fallback"  # nothing told the workers apart (or there was one)
        # A better-cached worker passed over for its load is a spill: say so.
        if (blocks > blocks[chosen]).any() and reason != "session":
            reason = "load"
        # Fallbacks: not overloaded first, then by cost, then by load, then by id.
        order = np.lexsort((np.arange(n), load, cost, over)).tolist()
        order.remove(chosen)
        return Decision(
            worker_id=ids[chosen],
            reason=reason,
            predicted_cached_tokens=int(cached[chosen]),
            ranked=(ids[chosen], *map(ids.__getitem__, order)),
        )

    def _kvroute_small(self, request: RouteRequest, ws: list[WorkerState]) -> Decision:
        # ``_kvroute``'s steps, operation for operation, one worker at a time.
        n, cfg, bs, prompt = len(ws), self.config, request.block_size, request.prompt_tokens
        rate = with_typical_rates(
            [w.prefill_tokens_per_s for w in ws], cfg.default_prefill_tokens_per_s
        )
        load = [max(w.running + w.waiting, w.inflight) for w in ws]
        queues = [float(max(w.waiting, w.pending)) for w in ws]
        work_s = [w.queued_prefill_tokens / r for w, r in zip(ws, rate, strict=True)]
        q_limit = self._limit(queues, QUEUE_SLACK, 1.0)
        w_limit = self._limit(work_s, WORK_SLACK_S, 0.0)
        over = [q + 1.0 > q_limit and s > w_limit for q, s in zip(queues, work_s, strict=True)]
        if all(over):
            over = [False] * n
        cached = [min(w.cached_blocks * bs, prompt) for w in ws]
        fleet_cached = max(cached)
        known = [w.capacity_blocks > 0 for w in ws]
        fill = [
            min(w.held_blocks / (w.capacity_blocks if k else 1.0), 1.0)
            for w, k in zip(ws, known, strict=True)
        ]
        pressure = [1.0] * n
        holders = [i for i in range(n) if known[i] and cached[i] == fleet_cached]
        if fleet_cached > 0 and holders:
            holder_fill = min(fill[i] for i in holders)
            gain = self._fill_gain(request)
            pressure = [
                max(0.0, 1.0 - gain * max(0.0, holder_fill - f)) if k else 1.0
                for f, k in zip(fill, known, strict=True)
            ]
        share = self._share(request, float(fleet_cached))
        cost = []
        for i, w in enumerate(ws):
            weight = 1.0 + (cfg.recompute_weight - 1.0) * pressure[i] * share
            uncached = float(max(prompt - cached[i], _MIN_UNCACHED_TOKENS))
            duplicate = max(fleet_cached - cached[i], 0.0)
            work = w.queued_prefill_tokens + uncached + (weight - 1.0) * duplicate
            decode = max(w.running, w.inflight) * cfg.decode_weight_s
            cost.append(work / rate[i] + decode)
        best = min(c for c, o in zip(cost, over, strict=True) if not o)
        bound = best * (1 + TIE_RELATIVE) + TIE_ABSOLUTE_S
        tied = [i for i in range(n) if not over[i] and cost[i] <= bound]
        ids = [w.worker_id for w in ws]
        session = next((i for i in tied if ids[i] == request.session_worker), None)
        if session is not None and len(tied) > 1:
            chosen, reason = session, "session"
        else:
            if self._keeps_history(request, fleet_cached):
                tied = [i for i in tied if cached[i] == fleet_cached] or tied
            chosen = self._least_loaded_rotating_small(tied, fill, known, load)
            if ws[chosen].cached_blocks > 0:
                reason = "cache"
            elif n > 1 and (len(tied) == 1 or len({load[i] for i in tied}) > 1):
                reason = "load"
            else:
                reason = "fallback"
        if reason != "session" and any(w.cached_blocks > ws[chosen].cached_blocks for w in ws):
            reason = "load"
        order = sorted(range(n), key=lambda i: (over[i], cost[i], load[i], i))
        return Decision(
            worker_id=ids[chosen],
            reason=reason,
            predicted_cached_tokens=int(cached[chosen]),
            ranked=(ids[chosen], *(ids[i] for i in order if i != chosen)),
        )

    def _least_loaded_rotating_small(
        self, tied: list[int], fill: list[float], known: list[bool], load: list[int]
    ) -> int:
        if self.replica_count > 1 and len(tied) > 1:
            home = [i for i in tied if i % self.replica_count == self.replica_rank]
            tied = home or tied
        if len(tied) > 1 and all(known[i] for i in tied):
            emptiest = min(fill[i] for i in tied)
            tied = [i for i in tied if fill[i] <= emptiest + FILL_TIE]
        low = min(load[i] for i in tied)
        least = [i for i in tied if load[i] == low]
        if len(least) == 1:
            return least[0]
        pick = least[self._cursor % len(least)]
        self._cursor += 1
        return pick

    def overloaded(self, workers: Sequence[WorkerState]) -> set[str]:
        """Ids of workers over the bounded-load limit (step 2), empty if all would be."""
        rates = [w.prefill_tokens_per_s for w in workers]
        rate = np.array(
            with_typical_rates(rates, self.config.default_prefill_tokens_per_s), dtype=np.float64
        )
        queues = np.array([worker_queue(w) for w in workers], dtype=np.float64)
        work_s = np.array([w.queued_prefill_tokens for w in workers], dtype=np.float64) / rate
        over = self._over(queues, work_s)
        return {w.worker_id for w, o in zip(workers, over.tolist(), strict=True) if o}

    def _over(self, queues: np.ndarray, work_s: np.ndarray) -> np.ndarray:
        """Mask of workers over the bounded-load limit (step 2), none if all would be."""
        # Counting this request in the queue length: it joins one of them.
        over = self._above_mask(queues, QUEUE_SLACK, extra=1.0) & self._above_mask(
            work_s, WORK_SLACK_S
        )
        return np.zeros_like(over) if over.all() else over

    def _above_mask(self, values: np.ndarray, slack: float, extra: float = 0.0) -> np.ndarray:
        return values + extra > self._limit(values.tolist(), slack, extra)

    def _limit(self, values: list[float], slack: float, extra: float) -> float:
        """The bounded-load limit on ``values`` (step 2), counting this request as ``extra``."""
        # fsum is exactly rounded, so both paths get the same limit whatever the order.
        mean = (math.fsum(values) + extra) / len(values)
        # On a small fleet a factor of 2 lets one worker hold most of the queue
        # (all of it on two workers): cap it at half, or three quarters on two.
        factor = min(self.config.balance_factor, max(1.5, len(values) / 2))
        return max(factor * mean, mean + slack)

    def _least_loaded_rotating(
        self, tied: np.ndarray, fill: np.ndarray, known: np.ndarray, load: np.ndarray
    ) -> int:
        if self.replica_count > 1 and len(tied) > 1:
            home = tied[tied % self.replica_count == self.replica_rank]
            tied = home if len(home) else tied
        if len(tied) > 1 and known[tied].all():
            emptiest = fill[tied].min()
            tied = tied[fill[tied] <= emptiest + FILL_TIE]
        low = load[tied].min()
        least = tied[load[tied] == low]
        if len(least) == 1:
            return int(least[0])
        # Rotate among equals so sequential cold requests spread over the fleet.
        pick = int(least[self._cursor % len(least)])
        self._cursor += 1
        return pick

    @staticmethod
    def _by_load(ws: list[WorkerState]) -> list[WorkerState]:
        return sorted(ws, key=lambda w: (worker_load(w), w.queued_prefill_tokens))

    @staticmethod
    def _cached_tokens(request: RouteRequest, w: WorkerState) -> int:
        return min(w.cached_blocks * request.block_size, request.prompt_tokens)

    def _decide(self, request: RouteRequest, order: list[WorkerState], reason: str) -> Decision:
        first = order[0]
        return Decision(
            worker_id=first.worker_id,
            reason=reason,
            predicted_cached_tokens=self._cached_tokens(request, first),
            ranked=tuple(w.worker_id for w in order),
        )
