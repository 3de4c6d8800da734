"""bench_router_paths on tiny sizes: both paths timed, the ratio computed from the figures."""

from __future__ import annotations

from loadtest import bench_router_paths


def test_both_paths_are_timed_and_the_ratio_follows_from_them() -> None:
    out = bench_router_paths.run(sizes=(2, 40), decisions=20, rounds=1)
    assert set(out["sizes"]) == {"2", "40"}
    for figures in out["sizes"].values():
        assert figures["plain_us"] > 0 and figures["numpy_us"] > 0
        assert figures["plain_vs_numpy"] == round(figures["plain_us"] / figures["numpy_us"], 3)
    faster = [int(n) for n, f in out["sizes"].items() if f["plain_vs_numpy"] < 1.0]
    assert out["plain_faster_up_to"] == (max(faster) if faster else 0)
