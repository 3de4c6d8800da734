"""``loadtest.bench_index_share`` end to end on a small fleet: a real owner process
serving its index over the socket, every look-up a full hit."""

from __future__ import annotations

from loadtest.bench_index_share import run


def test_a_small_fleet_is_served_and_every_lookup_hits() -> None:
    out = run(workers=4, blocks=4000, concurrency=2, seconds=0.3, chain_blocks=16)
    assert out["lookups"] > 10 and out["hit_fraction"] == 1.0
    assert out["owner_cpu_us_per_lookup"] > 0 and out["lookups_per_owner_core_s"] > 0
    assert out["lookup_wall_p50_ms"] <= out["lookup_wall_p99_ms"]
    assert out["chain_blocks"] == 16
