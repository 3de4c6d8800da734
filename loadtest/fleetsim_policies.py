"""The fleet simulator's routing policies: who gets each simulated request.

``make_route(sim, view)`` returns the function ``FleetSimulation`` calls on every
arrival at one gateway replica, for ``sim.cfg.policy``: the gateway's own
``Router`` for its policies (fed ``sim.worker_state``, the dispatcher's view of
each worker), or the ``loadtest.baselines`` ``chwbl`` and ``sglang_like`` (one
instance per replica: those routers share nothing between replicas). Each returns
``(worker, reason, blocks the gateway believes that worker has cached, the
last block of the longest cached prefix or None)``; the last goes to the
other replicas' prefix demand, as the gateway's route entries carry it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.routing.router import Router, RouterConfig, RouteRequest
from loadtest.baselines import Chwbl, SglangLike
from loadtest.workloads import RequestShape

if TYPE_CHECKING:
    from loadtest.fleetsim import FleetSimulation, GatewayView

__all__ = ["Route", "make_route"]

Route = Callable[[RequestShape, float], tuple[str, str, int, int | None]]


def make_route(sim: FleetSimulation, view: GatewayView, replica: int = 0) -> Route:
    """The routing function of ``sim.cfg.policy`` at gateway replica ``replica`` (``view``)."""
    cfg = sim.cfg
    wids = sorted(sim.workers)
    if cfg.policy == "chwbl":
        chwbl = Chwbl(wids, load_factor=cfg.chwbl_load_factor)

        def route_chwbl(shape: RequestShape, now: float) -> tuple[str, str, int, int | None]:
            key = shape.block_keys[0] if shape.block_keys else 0
            wid = chwbl.choose(int(key), view.inflight)  # type: ignore[call-overload]
            held = view.index.longest_prefix(shape.block_keys, now).get(wid, 0)
            return wid, "cache", held, None

        return route_chwbl
    if cfg.policy == "sglang_like":
        sglang = SglangLike(
            wids,
            cache_threshold=cfg.sglang_cache_threshold,
            balance_abs=cfg.sglang_balance_abs,
            balance_rel=cfg.sglang_balance_rel,
            max_tree_blocks=max(cfg.sglang_max_tree_tokens // cfg.block_size, 1),
        )

        def route_sglang(shape: RequestShape, now: float) -> tuple[str, str, int, int | None]:
            wid, reason, blocks = sglang.choose(
                shape.block_keys, shape.prompt_tokens, cfg.block_size, view.inflight
            )
            return wid, reason, blocks, None

        return route_sglang
    extra: dict[str, Any] = dict(cfg.router_options)
    # Replicas start their rotations apart, as the gateway's do (a random start);
    # the first keeps 0 so that one gateway's runs do not change.
    start = random.Random(f"{cfg.seed}-{replica}").randrange(1 << 20) if replica else 0
    router = Router(
        RouterConfig(
            policy=cfg.policy,
            balance_factor=cfg.balance_factor,
            seed=cfg.seed,
            **extra,
        ),
        rotation_start=start,
    )
    router.replica_rank, router.replica_count = replica, cfg.replicas

    def route_gateway(shape: RequestShape, now: float) -> tuple[str, str, int, int | None]:
        cached = view.index.longest_prefix(shape.block_keys, now)
        deepest = max(cached.values(), default=0)
        # The demand counts this request when it is routed (``GatewayView.routed``).
        prefix = shape.block_keys[deepest - 1] if deepest else None
        wanted = view.demand.wanted(prefix, now) + 1.0 if prefix is not None else 1.0
        states = [sim.worker_state(view, wid, cached.get(wid, 0), now) for wid in wids]
        decision = router.choose(
            RouteRequest(
                prompt_tokens=shape.prompt_tokens,
                block_size=cfg.block_size,
                session_worker=sim.session_worker(view, shape, now),
                prefix_demand=wanted,
            ),
            states,
        )
        blocks = next(s.cached_blocks for s in states if s.worker_id == decision.worker_id)
        return decision.worker_id, decision.reason, blocks, prefix

    return route_gateway
