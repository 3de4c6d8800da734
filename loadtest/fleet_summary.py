"""What ``bench_fleet`` (and ``bench_peers``) report from a policy's request results.

Pure functions over ``client.RequestResult`` rows: per-turn and overall hit
rate, TTFT and routing reasons (``summarize``, ``per_turn``), the kvroute vs
round_robin acceptance check, the emulated engine's time ``unscale`` and
``jsonable`` for strict JSON output. Numbers come from ``loadtest.stats``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from loadtest import stats
from loadtest.client import RequestResult

REASON_HEADER = "x-kvroute-reason"


def per_turn(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """Per 1-based turn: requests, mean prompt tokens, hit rate, TTFT mean/p50/p99, reasons."""
    out: dict[str, dict[str, Any]] = {}
    for turn in sorted({r.turn for r in results}):
        rows = [r for r in results if r.turn == turn and r.ok]
        ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
        lat = stats.latency_summary(ttfts)
        out[str(turn + 1)] = {
            "requests": len(rows),
            "prompt_tokens_mean": (
                sum(r.prompt_tokens for r in rows) / len(rows) if rows else math.nan
            ),
            "hit_rate": stats.hit_rate(
                [r.cached_tokens for r in rows], [r.prompt_tokens for r in rows]
            ),
            "ttft_mean_s": lat["mean"],
            "ttft_p50_s": lat["p50"],
            "ttft_p99_s": lat["p99"],
            "reasons": _reasons(rows),
        }
    return out


def _reasons(rows: Sequence[RequestResult]) -> dict[str, int]:
    """How many of ``rows`` the gateway routed for each reason ("?" = no reason header)."""
    return dict(sorted(Counter(r.headers.get(REASON_HEADER, "?") for r in rows).items()))


def summarize(results: Sequence[RequestResult], from_turn: int) -> dict[str, Any]:
    """Overall, per-turn and turn >= ``from_turn`` numbers of one policy's run."""
    ok = [r for r in results if r.ok]
    late = [r for r in ok if r.turn + 1 >= from_turn]
    start = min((r.sent_s for r in results), default=0.0)
    end = max((r.sent_s + (r.e2e_s or 0.0) for r in ok), default=0.0)
    ttft = stats.latency_summary([r.ttft_s for r in ok if r.ttft_s is not None])
    late_ttft = stats.latency_summary([r.ttft_s for r in late if r.ttft_s is not None])
    per_worker: dict[str, int] = Counter()
    for r in ok:
        per_worker[r.worker or "?"] += r.prompt_tokens
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": stats.error_summary(r.error for r in results),
        "hit_rate": stats.hit_rate([r.cached_tokens for r in ok], [r.prompt_tokens for r in ok]),
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p99_s": ttft["p99"],
        "late_turns": {
            "from_turn": from_turn,
            "requests": len(late),
            "hit_rate": stats.hit_rate(
                [r.cached_tokens for r in late], [r.prompt_tokens for r in late]
            ),
            "ttft_mean_s": late_ttft["mean"],
            "ttft_p50_s": late_ttft["p50"],
        },
        "throughput_rps": stats.throughput(len(ok), start, end),
        "output_tokens_per_s": stats.throughput(sum(r.completion_tokens for r in ok), start, end),
        "load_share": stats.load_share(dict(per_worker)),
        "reasons": _reasons(ok),
        "per_turn": per_turn(results),
    }


def acceptance(by_policy: dict[str, dict[str, Any]], from_turn: int) -> dict[str, Any]:
    """kvroute vs round_robin over turns >= ``from_turn``: hit rate and TTFT ratio."""
    if "kvroute" not in by_policy or "round_robin" not in by_policy:
        return {"checked": False, "why": "needs both kvroute and round_robin"}
    kv, rr = by_policy["kvroute"]["late_turns"], by_policy["round_robin"]["late_turns"]
    ratio = rr["ttft_mean_s"] / kv["ttft_mean_s"] if kv["ttft_mean_s"] > 0 else math.nan
    return {
        "checked": True,
        "from_turn": from_turn,
        "kvroute_hit_rate": kv["hit_rate"],
        "round_robin_hit_rate": rr["hit_rate"],
        "ttft_mean_ratio_rr_over_kvroute": ratio,
        "hit_rate_ge_90pct": kv["hit_rate"] >= 0.90,
        "ttft_2x_lower": ratio >= 2.0,
    }


def unscale(results: list[RequestResult], scale: float) -> list[RequestResult]:
    """Times of a run slowed down ``scale`` times (emulated engine, arrivals) back in real units.

    With ``--emulated-time-scale K`` every engine step and every arrival gap is
    K times longer, so the host's own CPU costs (HTTP, routing) shrink K-fold
    relative to the emulated GPU; dividing by K reports the emulated fleet's times.
    """
    if scale == 1.0:
        return results
    for r in results:
        r.sent_s /= scale
        r.ttft_s = None if r.ttft_s is None else r.ttft_s / scale
        r.e2e_s = None if r.e2e_s is None else r.e2e_s / scale
        r.itl_s = [gap / scale for gap in r.itl_s]
    return results


def jsonable(obj: Any) -> Any:
    """``obj`` with NaN/inf floats as ``None``, so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj
