"""bench_grpc_shapes end to end on a real grpc.aio server, tiny sizes."""

from __future__ import annotations

from loadtest import bench_grpc_shapes


def test_every_call_shape_serves_every_request_and_is_costed() -> None:
    out = bench_grpc_shapes.run(rounds=1, requests=64, concurrency=4)
    assert set(out["modes"]) == set(bench_grpc_shapes.MODES)
    for mode, figures in out["modes"].items():
        assert figures["cpu_ms_per_request"] > 0, mode
        assert figures["requests_per_s"] > 0, mode
    assert out["cpu_vs_unary_stream"]["unary_stream"] == 1.0
    # The ratios are computed from the reported figures, not written down.
    base = out["modes"]["unary_stream"]["cpu_ms_per_request"]
    for mode, ratio in out["cpu_vs_unary_stream"].items():
        assert ratio == round(out["modes"][mode]["cpu_ms_per_request"] / base, 3)
