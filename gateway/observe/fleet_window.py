"""Windowed rates and percentiles from the gateway's own counters, for the dashboard.

``FleetWindow`` keeps timestamped readings of every ``kvroute_gateway_*``
counter and histogram bucket (taken when the dashboard asks; one kept at most
every ``min_interval_s``) and answers "what changed over the last N seconds":
request, error and 429 rates, prompt and generated tokens per second, token hit
rate actual and predicted, TTFT percentiles — per worker and for the fleet.
The first reading is all zeros at start-up (every counter starts there), so the
figures are exactly what ``rate()`` over ``/metrics`` gives for the same span.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

Key = tuple[str, tuple[tuple[str, str], ...]]
PREFIX = "kvroute_gateway_"


@dataclass(frozen=True)
class Reading:
    """Every counter-like sample at one moment (monotonic seconds)."""

    at: float
    values: dict[Key, float]


def read_counters(families: Iterable[Metric]) -> dict[Key, float]:
    """Samples of the counters and histograms among ``families`` (a registry's
    ``collect()``, or a parsed exposition), keyed by name and labels."""
    out: dict[Key, float] = {}
    for family in families:
        if family.type not in ("counter", "histogram") or not family.name.startswith(PREFIX):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Delta:
    """The change of every sample between two readings."""

    def __init__(self, start: Reading, end: Reading) -> None:
        self.seconds = max(end.at - start.at, 1e-9)
        self.values = {k: v - start.values.get(k, 0.0) for k, v in end.values.items()}

    def total(self, name: str, **match: str) -> float:
        """Sum of ``name``'s increase over samples whose labels include ``match``
        (a value ending in ``*`` matches by prefix, e.g. ``code="5*"``)."""
        total = 0.0
        for (n, labels), v in self.values.items():
            if n == name and _matches(dict(labels), match):
                total += v
        return total

    def rate(self, name: str, **match: str) -> float:
        return self.total(name, **match) / self.seconds

    def quantile(self, q: float, name: str, **match: str) -> float | None:
        """``histogram_quantile(q, ...)`` over the window, or None without observations."""
        buckets: dict[float, float] = {}
        for (n, labels), v in self.values.items():
            d = dict(labels)
            if n == name + "_bucket" and _matches(d, match):
                le = float(d["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        return histogram_quantile(q, buckets)


def _matches(labels: dict[str, str], match: dict[str, str]) -> bool:
    for key, want in match.items():
        have = labels.get(key)
        if have is None:
            return False
        if want.endswith("*") and not have.startswith(want[:-1]):
            return False
        if not want.endswith("*") and have != want:
            return False
    return True


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' estimate: linear inside the bucket where rank ``q * count`` falls."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower  # beyond the last finite bucket: its bound is the best estimate
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


class FleetWindow:
    """Readings of the last ``max_window_s`` seconds, and deltas over any window within it."""

    def __init__(
        self,
        registry: CollectorRegistry,
        now: float,
        max_window_s: float = 3600.0,
        min_interval_s: float = 0.5,
    ) -> None:
        self.registry = registry
        self.max_window_s = max_window_s
        self.min_interval_s = min_interval_s
        self.started_at = now
        self._readings: deque[Reading] = deque([Reading(now, {})])

    def read(self, now: float, values: dict[Key, float] | None = None) -> Reading:
        """A fresh reading for ``now`` (of ``values`` when given: a multi-process
        gateway's merged counters); kept as a future window start at most every
        ``min_interval_s``, so many open pages do not grow the history."""
        if values is None:
            values = read_counters(self.registry.collect())
        reading = Reading(now, values)
        if now - self._readings[-1].at >= self.min_interval_s:
            self._readings.append(reading)
        # Keep one reading older than the longest window, as that window's start.
        while len(self._readings) > 2 and now - self._readings[1].at > self.max_window_s:
            self._readings.popleft()
        return reading

    def delta(self, now: float, window_s: float, values: dict[Key, float] | None = None) -> Delta:
        """Changes from the last reading at least ``window_s`` old (else the first) to now."""
        end = self.read(now, values)
        start = self._readings[0]
        for reading in self._readings:
            if now - reading.at >= window_s:
                start = reading
            else:
                break
        return Delta(start, end)
