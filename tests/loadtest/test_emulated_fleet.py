"""A fleet of emulated workers routes end to end: 4 worker processes (``--engine emulated``,
the H100 profile), a real gateway, real Redis, the real chat client, through ``bench_fleet``.

Emulated workers load only a tokenizer, so they start in seconds; the
gateway sees their block events like any worker's, and kvroute must keep each
conversation on the worker that holds it while round robin scatters them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_emulated_workers_route_by_cache(smollm2: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "loadtest.bench_fleet",
        "--model",
        str(smollm2),
        "--engine",
        "emulated",
        "--profile",
        "h100-llama3.1-8b",
        "--workers",
        "4",
        "--policies",
        "kvroute,round_robin",
        "--users",
        "8",
        "--turns",
        "3",
        "--system-tokens",
        "200",
        "--question-tokens",
        "32",
        "--answer-tokens",
        "32",
        "--think-time-s",
        "0.2",
        "--arrival-rate",
        "4",
        "--num-blocks",
        "512",
        "--json",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    kv, rr = out["policies"]["kvroute"], out["policies"]["round_robin"]
    for res in (kv, rr):
        assert res["requests"] == res["ok"] == 24 and res["errors"] == {}
        # The client's usage and the emulated workers' own /metrics counters agree.
        assert abs(res["worker_metrics"]["hit_rate"] - res["hit_rate"]) < 0.02
    # The shared system prompt pulls users to its worker; eight light users never queue
    # enough work there for the bound to spill them, and holding them costs no TTFT.
    # p99 of 24 requests is the slowest one: 50 ms of room for one scheduling stall of
    # the shared CI host (a run under its load measured 56 against 32 ms).
    assert kv["ttft_p99_s"] <= 1.5 * rr["ttft_p99_s"] + 0.05, (kv["ttft_p99_s"], rr["ttft_p99_s"])
    late_kv, late_rr = kv["late_turns"]["hit_rate"], rr["late_turns"]["hit_rate"]
    assert late_kv >= 0.75, kv["per_turn"]  # near the ideal: each turn adds ~70 new tokens
    assert late_kv > late_rr + 0.15, (late_kv, late_rr)  # rr hits only the system prompt
