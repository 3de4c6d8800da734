"""What a routers x workloads table of ``bench_peers --engine emulated`` says.

``verdict`` checks kvroute against every peer on every workload (hit rate and
TTFT p50/p99 at least as good) and 3 gateway replicas (and, when measured, a
gateway of 2 processes) against one (within 5 %); its ``target_met`` is computed from those checks. ``markdown`` is the
headline table the README quotes. ``loadtest.peers_matrix`` measures the table.
"""

from __future__ import annotations

from typing import Any


def verdict(table: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """kvroute vs every peer on every workload, and 3 replicas vs 1; ``target_met`` from these."""
    checks: dict[str, Any] = {}
    ok = True
    for workload, rows in table.items():
        kv = rows.get("kvroute", {})
        if "hit_rate" not in kv:
            checks[workload] = {"checked": False}
            ok = False
            continue
        row: dict[str, Any] = {}
        for peer in ("kvroute_round_robin", "sglang", "vllm"):
            p = rows.get(peer, {})
            if "hit_rate" not in p:
                row[peer] = "missing"
                ok = False
                continue
            wins = {
                "hit_rate": kv["hit_rate"] >= p["hit_rate"],
                "ttft_p50_s": kv["ttft_p50_s"] <= p["ttft_p50_s"],
                "ttft_p99_s": kv["ttft_p99_s"] <= p["ttft_p99_s"],
            }
            row[peer] = wins
            ok = ok and all(wins.values())
        for variant in ("kvroute_3_replicas", "kvroute_2_processes"):
            r = rows.get(variant, {})
            if "hit_rate" in r:
                same = {
                    "hit_rate_within_5pct": r["hit_rate"] >= 0.95 * kv["hit_rate"],
                    "ttft_p99_within_5pct": r["ttft_p99_s"] <= 1.05 * kv["ttft_p99_s"],
                }
                row[variant] = same
                ok = ok and all(same.values())
            elif variant == "kvroute_3_replicas":  # the issue's; two processes only if asked for
                row[variant] = "missing"
                ok = False
        checks[workload] = row
    return {"checks": checks, "target_met": ok}


def markdown(result: dict[str, Any]) -> str:
    """The headline table of a run: one row per workload and router."""
    lines = [
        "| workload | router | hit rate | TTFT p50 | TTFT p99 | output tok/s | max worker share |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, rows in result["workloads"].items():
        for router, r in rows.items():
            if "hit_rate" not in r:
                lines.append(f"| {workload} | {router} | error: {r.get('error', '?')} | | | | |")
                continue
            lines.append(
                f"| {workload} | {router} | {r['hit_rate']:.3f} | {r['ttft_p50_s'] * 1000:.1f} ms "
                f"| {r['ttft_p99_s'] * 1000:.1f} ms | {r['tokens_per_s']:.0f} "
                f"| {r['max_worker_share']:.2f} |"
            )
    return "\n".join(lines) + "\n"
