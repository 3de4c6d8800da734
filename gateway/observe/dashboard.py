"""The dashboard: a self-contained HTML page and the JSON it polls.

``GET /dashboard`` serves ``static/dashboard.html`` (inline JS and CSS, no
CDN); the page polls ``GET /dashboard/data`` and shows, per worker, the token
hit rate over the last minute (engine-reported beside gateway-predicted),
load, requests/s and the mix of routing reasons.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.edge.app_keys import STATE, GatewayState

_PAGE = Path(__file__).parent / "static" / "dashboard.html"


async def page(request: web.Request) -> web.Response:
    return web.Response(text=_PAGE.read_text(encoding="utf-8"), content_type="text/html")


def snapshot(state: GatewayState) -> dict[str, Any]:
    """Everything the page shows, as plain JSON."""
    summary = state.stats.summary(time.monotonic())
    healthy = {e.record.worker_id for e in state.dispatcher.healthy()}
    workers = []
    for wid, entry in sorted(state.mirror.workers.items()):
        s = state.dispatcher.state(entry, 0)
        row = summary.get(wid, {})
        workers.append(
            {
                "worker_id": wid,
                "address": entry.record.address,
                "healthy": wid in healthy,
                "index_blocks": state.index.block_count(wid),
                "event_lag_s": round(entry.event_lag_s, 4),
                "load": {
                    "running": s.running,
                    "waiting": s.waiting,
                    "inflight": s.inflight,
                    "queued_prefill_tokens": s.queued_prefill_tokens,
                    "free_blocks": entry.record.free_blocks,
                    "num_blocks": entry.record.num_blocks,
                },
                "requests": row.get("requests", 0),
                "requests_per_s": row.get("requests_per_s", 0.0),
                "prompt_tokens": row.get("prompt_tokens", 0),
                "hit_rate": row.get("hit_rate", 0.0),
                "predicted_hit_rate": row.get("predicted_hit_rate", 0.0),
                "reasons": row.get("reasons", {}),
            }
        )
    return {
        "time": time.time(),
        "model": state.config.model_name,
        "policy": state.config.router.policy,
        "window_s": state.stats.window_s,
        "ready": state.ready(),
        "redis": state.mirror.redis_ok,
        "workers": workers,
    }


async def data(request: web.Request) -> web.Response:
    return web.json_response(snapshot(request.app[STATE]))
