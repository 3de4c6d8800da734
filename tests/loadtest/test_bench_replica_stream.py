"""``loadtest.bench_replica_stream`` end to end on a private Redis: both formats are
published, every entry reaches the peer, and the figures come from the rounds."""

from __future__ import annotations

import statistics

from loadtest.bench_replica_stream import run


def test_both_formats_reach_the_peer_and_the_ratio_is_of_the_medians() -> None:
    out = run(rounds=2, routes=40, per_flush=4, blocks=16)
    rounds = out["rounds_us"]
    assert len(rounds["batched"]) == len(rounds["single"]) == 2
    assert all(v > 0 for v in rounds["batched"] + rounds["single"])
    batched, single = (statistics.median(rounds[m]) for m in ("batched", "single"))
    assert abs(out["cpu_us_per_entry_batched"] - batched) <= 0.1
    assert abs(out["batched_vs_single"] - batched / single) <= 0.01
