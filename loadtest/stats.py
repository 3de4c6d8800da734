"""Summary statistics of a load run or a simulation: pure functions over numbers.

Token hit rate is always token-weighted: cached prompt tokens / prompt tokens,
summed before dividing, exactly as the dashboards compute it from counters.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks.

    Matches ``numpy.percentile``'s default; NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p95 and p99 of ``values`` (NaN when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    return {
        "mean": mean,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


def hit_rate(cached_tokens: Iterable[int], prompt_tokens: Iterable[int]) -> float:
    """Token-weighted hit rate: sum(cached) / sum(prompt); NaN with no prompt tokens."""
    cached, prompt = sum(cached_tokens), sum(prompt_tokens)
    return cached / prompt if prompt else math.nan


def grouped_hit_rate(rows: Iterable[tuple[Hashable, int, int]]) -> dict[Hashable, float]:
    """Hit rate per group from ``(group, cached_tokens, prompt_tokens)`` rows."""
    cached: dict[Hashable, int] = defaultdict(int)
    prompt: dict[Hashable, int] = defaultdict(int)
    for group, c, p in rows:
        cached[group] += c
        prompt[group] += p
    return {g: (cached[g] / prompt[g] if prompt[g] else math.nan) for g in sorted(prompt, key=str)}


def load_share(loads: Mapping[K, float]) -> dict[K, float]:
    """Each key's fraction of the total (all zero when the total is zero)."""
    total = sum(loads.values())
    return {k: (v / total if total else 0.0) for k, v in loads.items()}


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation / mean; 0 for equal values, NaN for no values or mean 0."""
    if not values:
        return math.nan
    mean = sum(values) / len(values)
    if mean == 0:
        return math.nan
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


def throughput(count: float, start_s: float, end_s: float) -> float:
    """``count`` per second over ``[start_s, end_s]``; NaN for an empty window."""
    span = end_s - start_s
    return count / span if span > 0 else math.nan


def error_summary(errors: Iterable[str | None]) -> dict[str, int]:
    """Count of each error kind, ignoring ``None`` (success)."""
    out: dict[str, int] = defaultdict(int)
    for e in errors:
        if e is not None:
            out[e] += 1
    return dict(sorted(out.items()))
