"""``bench_dispatch`` routes a small fleet's hits and misses with the gateway's dispatcher."""

from __future__ import annotations

from loadtest.bench_dispatch import run


def test_routes_hits_and_misses_and_reports_their_cost() -> None:
    out = run(workers=40, blocks=2000, requests=40)
    assert (out["workers"], out["requests"]) == (40, 40)
    assert 0 < out["route_hit_p50_ms"] <= out["route_hit_p99_ms"]
    assert out["route_miss_p50_ms"] > 0
