"""Unit tests of the emulated-fleet comparison's pure parts: trace rescaling, the hub-cache
layout aiperf reads offline, and the verdict that computes ``target_met``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.aiperf_client import hub_cache, rescale_trace
from loadtest.peers_matrix import MatrixConfig, median_round
from loadtest.peers_report import markdown, verdict


def test_rescale_trace_keeps_hash_ids_and_scales_lengths(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 600, "output_length": 3, "hash_ids": [0, 5]},
        {"timestamp": 9000, "input_length": 10, "output_length": 1, "hash_ids": [7]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / "out.jsonl"
    shape = rescale_trace(src, dst, block_tokens=32, limit=2, time_scale=3.0, speedup=2.0)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert shape == {"requests": 2, "span_s": 1.0, "block_tokens": 32}
    # 1100 * 32/512 = 68.75 -> 69 tokens: within 3 blocks of 32 and past the second one.
    assert out[0] == {"timestamp": 0, "input_length": 69, "output_length": 4, "hash_ids": [0, 1, 2]}
    assert out[1] == {"timestamp": 3000, "input_length": 38, "output_length": 1, "hash_ids": [0, 5]}


def test_rescale_trace_spreads_the_requests_of_one_instant(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": t, "input_length": 40, "output_length": 8, "hash_ids": [i]}
        for i, t in enumerate([0, 0, 0, 0, 3000, 6000, 6000])
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / "out.jsonl"
    rescale_trace(src, dst, block_tokens=32, limit=7, speedup=2.0, spread=True)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["hash_ids"] for r in out] == [[i] for i in range(7)]
    assert [r["timestamp"] for r in out] == [0, 375, 750, 1125, 1500, 3000, 3750]
    with pytest.raises(ValueError, match="--trace-arrivals"):
        MatrixConfig(trace_arrivals="jittered")


def test_hub_cache_links_the_tokenizer_but_not_the_weights(tmp_path: Path) -> None:
    model = tmp_path / "Tiny-1"
    model.mkdir()
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        (model / name).write_text("{}")
    hub_id = hub_cache(str(model), tmp_path / "hub")
    repo = tmp_path / "hub" / "models--kvroute--Tiny-1"
    assert hub_id == "kvroute/Tiny-1"
    assert (repo / "refs" / "main").read_text() == "local"
    linked = sorted(p.name for p in (repo / "snapshots" / "local").iterdir())
    assert linked == ["config.json", "tokenizer.json"]
    assert hub_cache(str(model), tmp_path / "hub") == hub_id  # idempotent


def row(hit: float, p50: float, p99: float) -> dict[str, float]:
    return {
        "hit_rate": hit,
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "tokens_per_s": 100.0,
        "max_worker_share": 0.1,
    }


def test_verdict_needs_kvroute_best_on_every_figure() -> None:
    rows = {
        "kvroute": row(0.9, 0.1, 0.5),
        "kvroute_3_replicas": row(0.88, 0.1, 0.52),
        "kvroute_round_robin": row(0.5, 0.2, 0.9),
        "sglang": row(0.85, 0.1, 0.6),
        "vllm": row(0.8, 0.12, 0.7),
    }
    assert verdict({"w": rows})["target_met"] is True
    worse_p99 = {**rows, "vllm": row(0.8, 0.12, 0.4)}
    result = verdict({"w": worse_p99})
    assert result["target_met"] is False
    assert result["checks"]["w"]["vllm"] == {
        "hit_rate": True,
        "ttft_p50_s": True,
        "ttft_p99_s": False,
    }
    missing = {k: v for k, v in rows.items() if k != "sglang"}
    assert verdict({"w": missing})["target_met"] is False
    replicas_off = {**rows, "kvroute_3_replicas": row(0.8, 0.1, 0.5)}
    assert verdict({"w": replicas_off})["target_met"] is False
    # Two processes are checked like replicas, but only when they were measured.
    assert "kvroute_2_processes" not in verdict({"w": rows})["checks"]["w"]
    slow_processes = {**rows, "kvroute_2_processes": row(0.9, 0.1, 0.6)}
    result = verdict({"w": slow_processes})
    assert result["target_met"] is False
    processes = result["checks"]["w"]["kvroute_2_processes"]
    assert processes["hit_rate_within_5pct"] and not processes["ttft_p99_within_5pct"]
    assert "| w | kvroute | 0.900 | 100.0 ms | 500.0 ms | 100 | 0.10 |" in markdown(
        {"workloads": {"w": rows}}
    )


def test_rounds_report_each_figure_as_its_median_and_keep_the_rounds() -> None:
    rounds = [
        {**row(0.16, 0.030, 0.230), "gateway": {"predicted_hit_rate": 0.2}},
        {**row(0.15, 0.028, 0.210), "gateway": {"predicted_hit_rate": 0.4}},
        {"error": "RuntimeError: the fleet failed"},
        {**row(0.17, 0.029, 0.220), "gateway": {"predicted_hit_rate": 0.3}},
    ]
    merged = median_round(rounds)
    # The failed round is left out of the medians, and kept with the others.
    assert merged["hit_rate"] == pytest.approx(0.16)
    assert merged["ttft_p50_s"] == pytest.approx(0.029)
    assert merged["ttft_p99_s"] == pytest.approx(0.220)
    assert merged["gateway"]["predicted_hit_rate"] == pytest.approx(0.3)
    assert merged["rounds"] == rounds
    assert median_round(rounds[:1]) == rounds[0]  # one round: reported as measured
    failed = median_round([rounds[2], rounds[2]])
    assert failed["error"] == "RuntimeError: the fleet failed"
    with pytest.raises(ValueError, match="--rounds 0"):
        MatrixConfig(rounds=0)


def test_bursty_mixes_chat_and_groups_into_the_start_of_each_window() -> None:
    from loadtest.peers_matrix import MatrixConfig, synthetic
    from loadtest.workloads import BURST_ON_S, BURST_PERIOD_S

    mcfg = MatrixConfig()
    chat = synthetic("chat", mcfg, 1)
    groups = synthetic("shared_prefix", mcfg, 2)
    mixed = synthetic("bursty", mcfg, 1)
    assert sorted(c.conv_id for c in mixed) == sorted(c.conv_id for c in [*chat, *groups])
    assert all(c.start_s % BURST_PERIOD_S <= BURST_ON_S + 1e-9 for c in mixed)
    # the same requests, only sooner: turns and prompts unchanged
    by_id = {c.conv_id: c for c in [*chat, *groups]}
    for c in mixed:
        assert c.turns == by_id[c.conv_id].turns and c.start_s <= by_id[c.conv_id].start_s


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        # The real fleet's kvroute round robin is ``round_robin``: in the emulated matrix
        # it once ran kvroute's own policy under that name.
        (["--engine", "emulated", "--routers", "kvroute,round_robin"], "kvroute_round_robin"),
        (["--routers", "kvroute,kvroute_round_robin"], "round_robin"),
    ],
)
def test_bench_peers_refuses_the_other_comparisons_router_names(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtest import bench_peers

    assert bench_peers.main(argv) == 2
    err = capsys.readouterr().err
    assert "--routers" in err and named in err
