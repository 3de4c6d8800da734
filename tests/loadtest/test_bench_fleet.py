"""Smoke test of ``loadtest.bench_fleet``: two real fleets on tiny_llama, both policies, the CLI.

Real Redis, real worker processes, real gateways; the workload is tiny (2 users
x 3 turns, tens of tokens) so the whole run stays well under a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TURN_KEYS = {
    "requests",
    "prompt_tokens_mean",
    "hit_rate",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "reasons",
}


def test_bench_fleet_cli_kvroute_beats_round_robin(tiny_llama: Path, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    cmd = [
        sys.executable,
        "-m",
        "loadtest.bench_fleet",
        "--model",
        str(tiny_llama),
        "--workers",
        "2",
        "--policies",
        "kvroute,round_robin",
        "--users",
        "2",
        "--turns",
        "3",
        "--system-tokens",
        "64",
        "--question-tokens",
        "16",
        "--answer-tokens",
        "16",
        "--think-time-s",
        "0",
        # User 1 starts ~2.3 s after user 0 (seed 0), when user 0 is long done: round_robin
        # then alternates each user between the workers, and cannot line up with the
        # sessions by luck, so the comparison below is deterministic.
        "--arrival-rate",
        "0.5",
        "--num-blocks",
        "256",
        "--plot",
        str(plot),
        "--json",
        "--no-progress",
    ]
    # Generous: two real workers start and serve; a loaded CI box took over 150 s once.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)

    assert set(out) == {"config", "policies", "acceptance", "plot"}
    assert list(out["policies"]) == ["kvroute", "round_robin"]
    assert out["acceptance"]["checked"] is True
    assert plot.stat().st_size > 10_000
    for policy, res in out["policies"].items():
        assert res["policy"] == policy
        assert res["requests"] == res["ok"] == 6
        assert res["errors"] == {}
        assert list(res["per_turn"]) == ["1", "2", "3"]
        for row in res["per_turn"].values():
            assert set(row) == TURN_KEYS
            assert row["requests"] == 2
            assert row["ttft_mean_s"] > 0
        # The client's usage numbers and the workers' own counters agree.
        assert res["worker_metrics"]["prompt_tokens"] > 0
        assert abs(res["worker_metrics"]["hit_rate"] - res["hit_rate"]) < 1e-9

    kv, rr = out["policies"]["kvroute"], out["policies"]["round_robin"]
    assert sum(kv["reasons"].values()) == 6
    assert set(rr["reasons"]) == {"fallback"}  # round_robin never claims a cache decision

    def late_cached(res: dict) -> float:
        rows = [r for t, r in res["per_turn"].items() if int(t) >= 2]
        return sum(r["hit_rate"] * r["prompt_tokens_mean"] * r["requests"] for r in rows)

    assert late_cached(kv) > late_cached(rr)
    assert kv["late_turns"]["hit_rate"] > rr["late_turns"]["hit_rate"]
