"""``bench_scale``'s in-process half on a small fleet: the figures it reports come
from the gateway's own dispatcher routing real hits and misses."""

from __future__ import annotations

from loadtest.bench_scale import bench_fleet


def test_a_small_fleet_routes_its_hits_and_misses_and_reports_them() -> None:
    out = bench_fleet(workers=40, blocks=2000, lookups=60)
    assert out["workers"] == 40 and out["entries"] > 0
    # bench_fleet asserts each sampled chain is a full hit on its worker.
    for key in ("lookup_hit_p50_ms", "route_hit_p50_ms", "route_hit_p99_ms", "route_miss_p50_ms"):
        assert out[key] > 0, key
    assert out["route_hit_p99_ms"] >= out["route_hit_p50_ms"]
    assert 0 < out["index_bytes_per_entry_estimate"] < 400
