"""``loadtest.bench_replica_stream`` end to end on a private Redis: both formats are
published, every entry reaches the peer, and the figures come from the rounds."""

from __future__ import annotations

import statistics

from loadtest.bench_replica_stream import run


def test_both_formats_reach_the_peer_and_the_ratio_is_of_the_medians() -> None:
    out = run(rounds=2, routes=40, per_flush=4, blocks=16, busy=50)
    rounds = out["rounds_us"]
    assert len(rounds["today"]) == len(rounds["before"]) == 2
    assert all(v > 0 for v in rounds["today"] + rounds["before"])
    today, before = (statistics.median(rounds[m]) for m in ("today", "before"))
    assert abs(out["cpu_us_per_entry_today"] - today) <= 0.1
    assert abs(out["today_vs_before"] - today / before) <= 0.01
    assert out["busy_workers"] == 50
