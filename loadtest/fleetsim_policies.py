"""The fleet simulator's routing policies: who gets each simulated request.

``make_route(sim)`` returns the function ``FleetSimulation`` calls on every
arrival, for ``sim.cfg.policy``: the gateway's own ``Router`` for its
policies (fed ``sim.worker_state``, the dispatcher's view of each worker),
or the ``loadtest.baselines`` ``chwbl`` and ``sglang_like``. Each returns
``(worker, reason, blocks the gateway believes that worker has cached)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.routing.prefix_demand import PrefixDemand
from gateway.routing.router import Router, RouterConfig, RouteRequest
from loadtest.baselines import Chwbl, SglangLike
from loadtest.workloads import RequestShape

if TYPE_CHECKING:
    from loadtest.fleetsim import FleetSimulation

__all__ = ["Route", "make_route"]

Route = Callable[[RequestShape, float], tuple[str, str, int]]


def make_route(sim: FleetSimulation) -> Route:
    """The routing function of ``sim.cfg.policy`` over ``sim``'s gateway view."""
    cfg = sim.cfg
    wids = sorted(sim.workers)
    if cfg.policy == "chwbl":
        chwbl = Chwbl(wids, load_factor=cfg.chwbl_load_factor)

        def route_chwbl(shape: RequestShape, now: float) -> tuple[str, str, int]:
            key = shape.block_keys[0] if shape.block_keys else 0
            wid = chwbl.choose(int(key), sim.inflight)  # type: ignore[call-overload]
            return wid, "cache", sim.view_match(wid, shape.block_keys, now)

        return route_chwbl
    if cfg.policy == "sglang_like":
        sglang = SglangLike(
            wids,
            cache_threshold=cfg.sglang_cache_threshold,
            balance_abs=cfg.sglang_balance_abs,
            balance_rel=cfg.sglang_balance_rel,
            max_tree_blocks=max(cfg.sglang_max_tree_tokens // cfg.block_size, 1),
        )

        def route_sglang(shape: RequestShape, now: float) -> tuple[str, str, int]:
            return sglang.choose(
                shape.block_keys, shape.prompt_tokens, cfg.block_size, sim.inflight
            )

        return route_sglang
    extra: dict[str, Any] = dict(cfg.router_options)
    router = Router(
        RouterConfig(
            policy=cfg.policy,
            balance_factor=cfg.balance_factor,
            default_prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            seed=cfg.seed,
            **extra,
        )
    )

    demand = PrefixDemand()

    def route_gateway(shape: RequestShape, now: float) -> tuple[str, str, int]:
        cached = sim.index.longest_prefix(shape.block_keys, now)
        deepest = max(cached.values(), default=0)
        wanted = demand.observe(shape.block_keys[deepest - 1], now) if deepest else 1.0
        states = [sim.worker_state(wid, cached.get(wid, 0), now) for wid in wids]
        decision = router.choose(
            RouteRequest(
                prompt_tokens=shape.prompt_tokens,
                block_size=cfg.block_size,
                session_worker=sim.session_worker(shape, now),
                prefix_demand=wanted,
            ),
            states,
        )
        blocks = next(s.cached_blocks for s in states if s.worker_id == decision.worker_id)
        return decision.worker_id, decision.reason, blocks

    return route_gateway
