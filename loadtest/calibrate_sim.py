"""The simulator against the emulated fleet: the same workload, hit rate and TTFT p50 side by side.

    python -m loadtest.calibrate_sim BENCH_PEERS_JSON [--router kvroute]

Reads a ``bench_peers --engine emulated`` result, rebuilds its synthetic
workloads (``chat``, ``shared_prefix``: same seed, same shapes) and replays
them through ``loadtest.simulate``'s fleet with the time model of the run's
profile (prefill rate = 1 / ``prefill_token_s`` plus ``step_s`` per prefill, decode step = the profile's
step at the fleet's ``max_num_seqs`` / 2 and 1k context), its block size, fleet
size and per-worker capacity. Prints one JSON object: per workload the fleet's
and the simulator's hit rate and TTFT p50, their gaps, and ``target_met``
(hit rates within 0.02 and TTFT p50 within 20 %).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from contract.hashing import HashSpec
from loadtest.fleetsim import SimConfig
from loadtest.peers_matrix import MatrixConfig, synthetic
from loadtest.simulate import run_policy
from loadtest.workloads import conversation_shapes
from worker.model.emulated import load_profile

HIT_TOLERANCE = 0.02
TTFT_TOLERANCE = 0.20


def sim_config(fleet: dict[str, Any], policy: str, block_size: int = 16) -> SimConfig:
    """The simulator fleet that mirrors an emulated fleet's profile and shape."""
    model = load_profile(fleet["profile"]).time_model
    batch = max(1, fleet["max_num_seqs"] // 2)
    return SimConfig(
        workers=fleet["workers"],
        block_size=block_size,
        capacity_tokens=fleet["num_blocks"] * block_size,
        prefill_tokens_per_s=1.0 / model.prefill_token_s,
        prefill_step_s=model.step_s + model.logits_row_s,
        decode_step_s=model.decode_time(batch, 1024),
        heartbeat_s=0.5,
        policy=policy,
    )


def compare(result: dict[str, Any], router: str) -> dict[str, Any]:
    fleet = result["config"]["fleet"]
    mcfg = MatrixConfig(**{**result["config"]["matrix"], "workloads": ("chat", "shared_prefix")})
    policy = "round_robin" if router == "kvroute_round_robin" else "kvroute"
    out: dict[str, Any] = {}
    ok = True
    for workload in ("chat", "shared_prefix"):
        measured = result["workloads"].get(workload, {}).get(router, {})
        if "hit_rate" not in measured:
            continue
        convs = synthetic(workload, mcfg, seed=0)
        shapes = conversation_shapes(convs, HashSpec(block_size=16, model="calibration"))
        sim = run_policy(sim_config(fleet, policy), shapes, progress=False)
        hit_gap = sim["hit_rate"] - measured["hit_rate"]
        ttft_ratio = sim["ttft_p50_s"] / measured["ttft_p50_s"]
        passes = abs(hit_gap) <= HIT_TOLERANCE and abs(ttft_ratio - 1) <= TTFT_TOLERANCE
        ok = ok and passes
        out[workload] = {
            "fleet_hit_rate": measured["hit_rate"],
            "sim_hit_rate": sim["hit_rate"],
            "hit_gap": hit_gap,
            "fleet_ttft_p50_s": measured["ttft_p50_s"],
            "sim_ttft_p50_s": sim["ttft_p50_s"],
            "ttft_p50_ratio": ttft_ratio,
            "passes": passes,
        }
    return {"router": router, "workloads": out, "target_met": ok and bool(out)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.calibrate_sim", description=__doc__)
    p.add_argument("result", help="JSON printed by bench_peers --engine emulated")
    p.add_argument("--router", default="kvroute")
    args = p.parse_args(argv)
    with open(args.result, encoding="utf-8") as fh:
        result = json.load(fh)
    print(json.dumps(compare(result, args.router)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
