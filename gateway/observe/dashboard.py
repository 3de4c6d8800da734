"""The dashboard: a self-contained HTML page and the JSON it polls.

``GET /dashboard`` serves ``static/dashboard.html`` (inline JS and CSS, no
CDN); the page polls ``GET /dashboard/data?window=S`` and shows the fleet
(healthy workers, request / error / 429 rates, prompt and generated tokens per
second, in-flight and queued requests, token hit rate actual beside predicted,
TTFT p50/p95/p99) and a row per worker (in flight, running, waiting, queued
prefill tokens, KV blocks used + free = capacity, blocks in the index, rates,
hit rates, TTFT p95, routing reasons). Rates and percentiles are computed over
the window from the same counters ``/metrics`` exports (``FleetWindow``);
in-flight and queue figures are live, so a busy fleet never reads as idle.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.app_keys import STATE, GatewayState
from gateway.observe.fleet_window import Delta, FleetWindow, Key, read_counters

_PAGE = Path(__file__).parent / "static" / "dashboard.html"
WINDOW = web.AppKey("fleet_window", FleetWindow)
DEFAULT_WINDOW_S = 60.0
G = "kvroute_gateway_"


async def page(request: web.Request) -> web.Response:
    return web.Response(text=_PAGE.read_text(encoding="utf-8"), content_type="text/html")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _traffic(d: Delta, **match: str) -> dict[str, Any]:
    """Rates, hit rates and TTFT over the window, for one worker or (no match) the fleet."""
    prompt = d.total(G + "prompt_tokens_total", **match)
    return {
        "requests_per_s": d.rate(G + "requests_total", **match),
        "prompt_tokens_per_s": prompt / d.seconds,
        "generation_tokens_per_s": d.rate(G + "generation_tokens_total", **match),
        "hit_rate": _ratio(d.total(G + "cached_tokens_total", **match), prompt),
        "predicted_hit_rate": _ratio(d.total(G + "predicted_cached_tokens_total", **match), prompt),
        "ttft_p50_s": d.quantile(0.5, G + "ttft_seconds", **match),
        "ttft_p95_s": d.quantile(0.95, G + "ttft_seconds", **match),
        "ttft_p99_s": d.quantile(0.99, G + "ttft_seconds", **match),
    }


def _counts(d: Delta, name: str, label: str, **match: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for (n, labels), v in d.values.items():
        ld = dict(labels)
        if n == name and all(ld.get(k) == want for k, want in match.items()) and v:
            out[ld[label]] = out.get(ld[label], 0) + round(v)
    return out


def snapshot(
    state: GatewayState,
    window: FleetWindow,
    window_s: float,
    counters: dict[Key, float] | None = None,
) -> dict[str, Any]:
    """Everything the page shows, as plain JSON (traffic from ``counters`` when given:
    a multi-process gateway's, merged across its processes)."""
    now = time.monotonic()
    d = window.delta(now, window_s, counters)
    healthy = {e.record.worker_id for e in state.dispatcher.healthy()}
    workers = []
    for wid, entry in sorted(state.mirror.workers.items()):
        s = state.dispatcher.state(entry, 0)
        rec = entry.record
        total = int(rec.num_blocks)
        free = min(int(rec.free_blocks), total) if total else int(rec.free_blocks)
        workers.append(
            {
                "worker_id": wid,
                "address": rec.address,
                "transport": getattr(rec, "transport", "grpc"),
                "healthy": wid in healthy,
                "inflight": s.inflight,
                "running": s.running,
                "waiting": s.waiting,
                "queued_prefill_tokens": s.queued_prefill_tokens,
                "blocks": {"used": max(total - free, 0), "free": free, "total": total},
                "index_blocks": state.dispatcher.index.block_count(wid),
                "event_lag_s": round(entry.event_lag_s, 4),
                **_traffic(d, worker_id=wid),
                "reasons": _counts(d, G + "requests_total", "reason", worker_id=wid),
            }
        )
    responses = _counts(d, G + "responses_total", "code")
    fleet = {
        "workers": len(workers),
        "healthy_workers": len(healthy),
        **_traffic(d),
        "responses_per_s": d.rate(G + "responses_total"),
        "errors_per_s": d.rate(G + "responses_total", code="5*"),
        "rejected_per_s": d.rate(G + "responses_total", code="429"),
        "inflight": sum(w["inflight"] for w in workers),
        "running": sum(w["running"] for w in workers),
        "waiting": sum(w["waiting"] for w in workers),
        "queued_prefill_tokens": sum(w["queued_prefill_tokens"] for w in workers),
        "blocks": {k: sum(w["blocks"][k] for w in workers) for k in ("used", "free", "total")},
        "index_blocks": sum(w["index_blocks"] for w in workers),
        "responses": responses,
    }
    return {
        "time": time.time(),
        "model": state.config.model_name,
        "policy": state.config.router.policy,
        "window_s": d.seconds,
        "ready": state.ready(),
        "redis": state.mirror.redis_ok,
        "fleet": fleet,
        "workers": workers,
    }


async def data(request: web.Request) -> web.Response:
    try:
        window_s = float(request.query.get("window", DEFAULT_WINDOW_S))
    except ValueError:
        window_s = DEFAULT_WINDOW_S
    window_s = min(max(window_s, 1.0), request.app[WINDOW].max_window_s)
    state = request.app[STATE]
    counters = None
    if state.pod is not None:  # one process of several: show the whole pod's traffic
        text = (await state.pod.pod_metrics()).decode()
        counters = read_counters(text_string_to_metric_families(text))
    return web.json_response(snapshot(state, request.app[WINDOW], window_s, counters))
