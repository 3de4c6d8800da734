"""Stats maths on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest import stats


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(xs, 50) == 2.5
    assert stats.percentile(xs, 95) == pytest.approx(3.85)
    assert stats.percentile(xs, 0) == 1.0 and stats.percentile(xs, 100) == 4.0
    ys = [0.3, 7.0, 1.5, 2.25, 9.0, 0.1, 4.0]
    for q in (1, 50, 95, 99):
        assert stats.percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError):
        stats.percentile(xs, 101)


def test_latency_summary() -> None:
    s = stats.latency_summary([1.0, 2.0, 3.0])
    assert s == {"mean": 2.0, "p50": 2.0, "p95": pytest.approx(2.9), "p99": pytest.approx(2.98)}


def test_hit_rate_is_token_weighted() -> None:
    # Per-request rates 0.5, 0, 1 average to 0.5; token-weighted it is 40 / 60.
    assert stats.hit_rate([10, 0, 30], [20, 10, 30]) == pytest.approx(2 / 3)
    assert math.isnan(stats.hit_rate([], []))


def test_grouped_hit_rate() -> None:
    rows = [("w1", 10, 20), ("w0", 0, 10), ("w1", 30, 30), ("w0", 5, 10)]
    assert stats.grouped_hit_rate(rows) == {"w0": 0.25, "w1": 0.8}


def test_coefficient_of_variation() -> None:
    assert stats.coefficient_of_variation([3, 3, 3]) == 0.0
    # mean 5, population std 2
    assert stats.coefficient_of_variation([2, 4, 4, 4, 5, 5, 7, 9]) == pytest.approx(0.4)
    assert math.isnan(stats.coefficient_of_variation([]))


def test_load_share_throughput_errors() -> None:
    assert stats.load_share({"a": 1, "b": 3}) == {"a": 0.25, "b": 0.75}
    assert stats.load_share({"a": 0}) == {"a": 0.0}
    assert stats.throughput(30, 2.0, 12.0) == 3.0
    assert math.isnan(stats.throughput(1, 5.0, 5.0))
    assert stats.error_summary([None, "http_500", None, "http_500", "no_tokens"]) == {
        "http_500": 2,
        "no_tokens": 1,
    }
