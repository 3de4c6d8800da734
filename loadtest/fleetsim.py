"""The fleet simulator: the production router in front of simulated workers.

A discrete-event simulation of one gateway and N workers:

- Each worker has a real ``BlockCache`` of ``capacity_tokens / block_size``
  blocks and one FCFS prefill queue served at ``prefill_tokens_per_s`` (plus
  ``prefill_step_s`` per request); a
  request's blocks are acquired (hit measured, room evicted) when its prefill
  starts, so ``TTFT = queue wait + max(prompt - cached, 1) / rate``. Decode
  then takes ``(output_tokens - 1) * decode_step_s``; decoding requests run in
  parallel (a continuous batch) and keep their blocks pinned until they end.
- The gateway's view of each worker is what its index mirror would hold: the
  worker's KV events (stored at prefill end, removed at eviction) applied
  ``event_delay_s`` later, plus speculative entries held from each routing
  until the request's first token (at most ``first_token_timeout_s``) and
  ``speculative_ttl_s`` after it, exactly as the gateway's dispatcher holds them. Registry load
  (running, waiting, queued prefill tokens, free blocks) is refreshed every
  ``heartbeat_s`` and corrected by ``gateway.routing.load.corrected_load``, the
  function the gateway's dispatcher calls; ``inflight`` is the gateway's own
  exact count. The gateway's view of blocks is ``gateway.routing.index.BlockIndex``
  itself, fed the workers' events ``event_delay_s`` late plus speculative entries.
- Gateway policies are decided by ``gateway.routing.router.Router`` itself;
  ``chwbl`` and ``sglang_like`` come from ``loadtest.baselines``
  (``loadtest.fleetsim_policies`` builds the routing function of each).

Multi-turn shapes (``RequestShape.after``) arrive when their previous turn
finishes plus the think time, so the open loop of users is closed per user.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.routing.index import BlockIndex
from gateway.routing.load import corrected_load
from gateway.routing.prefix_demand import PrefixDemand
from gateway.routing.router import POLICIES, RouterConfig, WorkerState
from loadtest.blockcache import BlockCache
from loadtest.fleetsim_policies import Route, make_route
from loadtest.workloads import RequestShape

SIM_POLICIES = (*POLICIES, "chwbl", "sglang_like")


@dataclass(frozen=True)
class SimConfig:
    """The fleet, its time model, the gateway's view lag, and the policy."""

    workers: int = 8
    block_size: int = 512
    capacity_tokens: int = 3_000_000
    prefill_tokens_per_s: float = 10_000.0
    prefill_step_s: float = 0.0  # fixed cost of a prefill (a GPU step reads every weight once)
    decode_step_s: float = 0.025
    event_delay_s: float = 0.05
    heartbeat_s: float = 1.0  # 0 = the router sees live load
    speculative_ttl_s: float = 2.0
    first_token_timeout_s: float = 60.0  # the gateway's default: bounds a speculative hold
    max_num_seqs: int = 0  # sequences a worker runs at once, prefill included (0 = no cap)
    session_ttl_s: float = 600.0
    policy: str = "kvroute"
    balance_factor: float = RouterConfig.balance_factor
    seed: int = 0
    chwbl_load_factor: float = 1.25
    sglang_cache_threshold: float = 0.5
    sglang_balance_abs: int = 32
    sglang_balance_rel: float = 1.0001
    sglang_max_tree_tokens: int = 4_194_304
    router_options: tuple[tuple[str, object], ...] = ()  # extra RouterConfig fields
    # Gateway replicas taking requests in turn (aiperf's round robin over URLs), each
    # learning what the others routed ``replica_lag_s`` late (``gateway.routing.replicas``).
    replicas: int = 1
    replica_lag_s: float = 0.004

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("--workers must be >= 1")
        if self.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.capacity_tokens < self.block_size:
            raise ValueError("--capacity-tokens must hold at least one block")
        if not self.prefill_tokens_per_s > 0:
            raise ValueError("--prefill-tokens-per-s must be positive")
        for name in (
            "prefill_step_s",
            "decode_step_s",
            "event_delay_s",
            "heartbeat_s",
            "speculative_ttl_s",
            "first_token_timeout_s",
            "session_ttl_s",
            "replica_lag_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(SIM_POLICIES)}")

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_size

    @property
    def hold_s(self) -> float:
        """A routed chain's longest speculative hold (``Dispatcher._hold_s``)."""
        if self.speculative_ttl_s <= 0:
            return 0.0
        return self.first_token_timeout_s + self.speculative_ttl_s


@dataclass(slots=True)
class RequestRecord:
    """What happened to one simulated request."""

    shape: RequestShape
    arrival_s: float
    worker: str = ""
    reason: str = ""
    predicted_cached_tokens: int = 0
    queued_estimate: int = 0
    start_s: float = math.nan
    cached_tokens: int = 0
    ttft_s: float = math.nan
    finish_s: float = math.nan
    stored: list[Hashable] = field(default_factory=list)
    gateway: GatewayView | None = None  # the replica that routed it


@dataclass
class _Worker:
    wid: str
    cache: BlockCache
    queue: deque[RequestRecord] = field(default_factory=deque)
    current: RequestRecord | None = None
    current_end: float = 0.0
    current_tokens: int = 0
    queued_estimate: int = 0
    decoding: int = 0
    # The prefill rate the engine reports: 0 until its first prefill has been timed
    # (``worker.engine.types.RateMeter``), so the router must assume one for it.
    measured_rate: float = 0.0

    def live_state(self, now: float) -> tuple[int, int, int, int]:
        """(running, waiting, queued prefill tokens, free blocks) as the engine reports them."""
        remaining = 0
        if self.current is not None:
            span = max(self.current_end - self.current.start_s, 1e-12)
            remaining = int(self.current_tokens * max(self.current_end - now, 0.0) / span)
        running = self.decoding + (self.current is not None)
        return running, len(self.queue), self.queued_estimate + remaining, self.cache.free_blocks


class GatewayView:
    """One gateway replica's view of the fleet, as its dispatcher keeps it.

    Its index mirror (the workers' events plus speculative entries), its
    in-flight counts per worker, its sessions and its router. What a replica
    routes reaches the others ``replica_lag_s`` late (``FleetSimulation``
    replays each change there), as ``gateway.routing.replicas`` shares it.
    """

    def __init__(self, ids: list[str]) -> None:
        self.index = BlockIndex()
        for wid in ids:
            self.index.add(wid, ())
        self.inflight: dict[str, int] = dict.fromkeys(ids, 0)
        self.pending: dict[str, int] = dict.fromkeys(ids, 0)  # sent, no first token yet
        # Prompt tokens sent but not yet through prefill, per worker.
        self.pending_prefill: dict[str, int] = dict.fromkeys(ids, 0)
        self.finished_at: dict[str, list[float]] = {wid: [] for wid in ids}
        self.sessions: dict[str, tuple[str, float]] = {}
        self.demand = PrefixDemand()
        self.route: Route | None = None  # set by FleetSimulation (it needs the view)

    def routed(self, rec: RequestRecord, prefix_key: int | None, hold_s: float, now: float) -> None:
        """``rec`` was just sent to its worker (by this replica or, heard now, a peer)."""
        shape, wid = rec.shape, rec.worker
        self.index.speculate(wid, shape.block_keys, now, hold_s)
        self.inflight[wid] += 1
        self.pending[wid] += 1
        self.pending_prefill[wid] += shape.prompt_tokens - rec.predicted_cached_tokens
        if shape.session is not None:
            self.sessions[shape.session] = (wid, now)
        if prefix_key is not None:
            self.demand.observe(prefix_key, now)

    def first_token(self, rec: RequestRecord, grace_s: float, now: float) -> None:
        """``rec``'s prefill ended: its hold becomes the grace."""
        self.pending_prefill[rec.worker] -= rec.shape.prompt_tokens - rec.predicted_cached_tokens
        self.pending[rec.worker] -= 1
        if grace_s > 0:
            self.index.speculate(rec.worker, rec.shape.block_keys, now, grace_s)

    def finished(self, rec: RequestRecord, now: float) -> None:
        self.inflight[rec.worker] -= 1
        self.finished_at[rec.worker].append(now)


class FleetSimulation:
    """One run of ``shapes`` through the fleet under ``config``."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        ids = [f"w{i}" for i in range(config.workers)]
        self.workers = {wid: _Worker(wid, BlockCache(config.capacity_blocks)) for wid in ids}
        # Registry load (running, waiting, queued prefill tokens, free blocks), shared by
        # every replica: each reads the same heartbeats.
        self.snapshot: dict[str, tuple[int, int, int, int]] = {
            wid: (0, 0, 0, w.cache.free_blocks) for wid, w in self.workers.items()
        }
        self.reported_rate = dict.fromkeys(ids, 0.0)  # the heartbeats' prefill rates
        self.gateways = [GatewayView(ids) for _ in range(config.replicas)]
        for i, view in enumerate(self.gateways):
            view.route = make_route(self, view, replica=i)
        self.records: list[RequestRecord] = []
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._pending = 0  # events other than heartbeats
        self._followers: dict[str, list[RequestShape]] = defaultdict(list)

    # -- driving -----------------------------------------------------------------

    def run(
        self,
        shapes: Iterable[RequestShape],
        on_finish: Callable[[RequestRecord], None] | None = None,
    ) -> list[RequestRecord]:
        """Simulate every shape to completion; records in arrival order."""
        for shape in shapes:
            if shape.after is None:
                self._push(shape.arrival_s, _ARRIVE, shape)
            else:
                self._followers[shape.after].append(shape)
        if self.cfg.heartbeat_s > 0:
            self._push(0.0, _HEARTBEAT, None, counted=False)
        handlers: dict[int, Callable[[float, Any], None]] = {
            _ARRIVE: self._arrive,
            _PREFILL_DONE: self._prefill_done,
            _FINISH: self._finish,
            _STORED: self._stored,
            _REMOVED: self._removed,
            _HEARTBEAT: self._heartbeat,
            _PEER: self._peer,
        }
        while self._heap:
            now, _, kind, data = heapq.heappop(self._heap)
            if kind != _HEARTBEAT:
                self._pending -= 1
            handlers[kind](now, data)
            if kind == _FINISH and on_finish is not None:
                on_finish(data)  # type: ignore[arg-type]
        return self.records

    def _push(self, t: float, kind: int, data: object, *, counted: bool = True) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, data))
        if counted:
            self._pending += 1

    def _share(
        self, origin: GatewayView, now: float, change: Callable[..., None], *args: Any
    ) -> None:
        """Applies a gateway change at ``origin`` now and at every other replica ``replica_lag_s`` later."""
        change(origin, *args, now)
        for view in self.gateways:
            if view is not origin:
                self._push(now + self.cfg.replica_lag_s, _PEER, (change, view, args))

    # -- events ------------------------------------------------------------------

    def _arrive(self, now: float, shape: RequestShape) -> None:
        view = self.gateways[len(self.records) % len(self.gateways)]
        rec = RequestRecord(shape=shape, arrival_s=now, gateway=view)
        self.records.append(rec)
        assert view.route is not None
        wid, reason, predicted_blocks, prefix_key = view.route(shape, now)
        rec.worker, rec.reason = wid, reason
        rec.predicted_cached_tokens = min(
            predicted_blocks * self.cfg.block_size, shape.prompt_tokens
        )
        self._share(view, now, GatewayView.routed, rec, prefix_key, self.cfg.hold_s)
        w = self.workers[wid]
        rec.queued_estimate = (
            shape.prompt_tokens - w.cache.match(shape.block_keys) * self.cfg.block_size
        )
        w.queued_estimate += rec.queued_estimate
        w.queue.append(rec)
        self._maybe_start(w, now)

    def _maybe_start(self, w: _Worker, now: float) -> None:
        """Starts the next queued prefill if the worker is free and its batch has room."""
        cap = self.cfg.max_num_seqs
        if w.current is None and w.queue and (cap <= 0 or w.decoding < cap):
            self._start_next(w, now)

    def _start_next(self, w: _Worker, now: float) -> None:
        rec = w.queue.popleft()
        w.queued_estimate -= rec.queued_estimate
        shape = rec.shape
        hit, stored, evicted = w.cache.acquire(shape.block_keys)
        rec.cached_tokens = min(hit * self.cfg.block_size, max(shape.prompt_tokens - 1, 0))
        rec.stored = stored
        rec.start_s = now
        uncached = max(shape.prompt_tokens - rec.cached_tokens, 1)
        w.current, w.current_tokens = rec, uncached
        w.current_end = now + self.cfg.prefill_step_s + uncached / self.cfg.prefill_tokens_per_s
        if evicted:
            self._push(now + self.cfg.event_delay_s, _REMOVED, (w.wid, evicted))
        self._push(w.current_end, _PREFILL_DONE, w)

    def _prefill_done(self, now: float, w: _Worker) -> None:
        rec = w.current
        assert rec is not None and rec.gateway is not None  # only scheduled while a prefill runs
        rec.ttft_s = now - rec.arrival_s
        # The gateway's hold ends at the first token: the grace starts now.
        self._share(rec.gateway, now, GatewayView.first_token, rec, self.cfg.speculative_ttl_s)
        if rec.stored:
            self._push(now + self.cfg.event_delay_s, _STORED, (w.wid, rec.stored))
        w.current = None
        w.measured_rate = self.cfg.prefill_tokens_per_s
        w.decoding += 1
        decode = max(rec.shape.output_tokens - 1, 0) * self.cfg.decode_step_s
        self._push(now + decode, _FINISH, rec)
        self._maybe_start(w, now)

    def _finish(self, now: float, rec: RequestRecord) -> None:
        w = self.workers[rec.worker]
        shape = rec.shape
        rec.finish_s = now
        w.decoding -= 1
        assert rec.gateway is not None
        self._share(rec.gateway, now, GatewayView.finished, rec)
        chain = shape.block_keys + shape.output_block_keys
        if shape.output_block_keys:
            _, stored, evicted = w.cache.acquire(shape.output_block_keys)
            if evicted:
                self._push(now + self.cfg.event_delay_s, _REMOVED, (w.wid, evicted))
            if stored:
                self._push(now + self.cfg.event_delay_s, _STORED, (w.wid, stored))
        w.cache.release(chain)
        for nxt in self._followers.pop(shape.request_id, ()):
            self._push(now + nxt.think_s, _ARRIVE, nxt)
        self._maybe_start(w, now)  # a batch slot is free

    def _stored(self, now: float, data: tuple[str, list[int]]) -> None:
        for view in self.gateways:  # every replica mirrors the same events
            view.index.add(data[0], data[1])

    def _removed(self, now: float, data: tuple[str, list[int]]) -> None:
        for view in self.gateways:
            view.index.remove(data[0], data[1])

    def _peer(
        self, now: float, data: tuple[Callable[..., None], GatewayView, tuple[Any, ...]]
    ) -> None:
        change, view, args = data
        change(view, *args, now)

    def _heartbeat(self, now: float, _: object) -> None:
        for wid, w in self.workers.items():
            self.snapshot[wid] = w.live_state(now)
            self.reported_rate[wid] = w.measured_rate
        for view in self.gateways:
            for finishes in view.finished_at.values():
                finishes.clear()  # the new snapshot already counts them
            view.index.prune(now)
        if self._pending > 0:
            self._push(now + self.cfg.heartbeat_s, _HEARTBEAT, None, counted=False)

    # -- routing -----------------------------------------------------------------

    def worker_state(
        self, view: GatewayView, wid: str, cached_blocks: int, now: float
    ) -> WorkerState:
        """``view``'s router's view of ``wid``, built the way ``gateway.routing.dispatch`` builds it."""
        cfg = self.cfg
        if cfg.heartbeat_s == 0:
            running, waiting, queued, _ = self.workers[wid].live_state(now)
            queued = max(queued, view.pending_prefill[wid])
            rate = self.workers[wid].measured_rate
        else:
            rate = self.reported_rate[wid]
            running, waiting, queued, _ = self.snapshot[wid]
            running, waiting, queued = corrected_load(
                running, waiting, queued, len(view.finished_at[wid]), view.pending_prefill[wid]
            )
        return WorkerState(
            worker_id=wid,
            cached_blocks=cached_blocks,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rate,
            inflight=view.inflight[wid],
            pending=view.pending[wid],
            held_blocks=view.index.block_count(wid),
            capacity_blocks=cfg.capacity_blocks,
        )

    def session_worker(self, view: GatewayView, shape: RequestShape, now: float) -> str | None:
        """The worker ``shape``'s session is bound to at ``view``, if not expired."""
        if shape.session is None:
            return None
        entry = view.sessions.get(shape.session)
        if entry is None or now - entry[1] > self.cfg.session_ttl_s:
            return None
        return entry[0]


_ARRIVE, _PREFILL_DONE, _FINISH, _STORED, _REMOVED, _HEARTBEAT, _PEER = range(7)


def ideal_hit_rate(records: Iterable[RequestRecord], block_size: int) -> float:
    """Hit rate of one unlimited cache replaying the same requests in arrival order."""
    held: set[Hashable] = set()
    cached = prompt = 0
    for rec in records:
        shape = rec.shape
        n = 0
        for key in shape.block_keys:
            if key not in held:
                break
            n += 1
        cached += min(n * block_size, max(shape.prompt_tokens - 1, 0))
        prompt += shape.prompt_tokens
        held.update(shape.block_keys)
        held.update(shape.output_block_keys)
    return cached / prompt if prompt else math.nan
