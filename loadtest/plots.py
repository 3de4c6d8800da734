"""PNG charts of real-fleet benchmark results (matplotlib, headless).

``plot_per_turn`` draws what ``loadtest.bench_fleet`` measures: token hit rate
per turn and TTFT per turn, one line per routing policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_per_turn(
    by_policy: Mapping[str, Mapping[str, Any]], path: str | Path, *, title: str = ""
) -> None:
    """Two panels, x = turn: token hit rate, and mean TTFT (p50 dashed), one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (policy, result) in enumerate(by_policy.items()):
        colour = f"C{i}"
        rows = result["per_turn"]
        turns = sorted(rows, key=int)
        x = [int(t) for t in turns]
        hit = [rows[t]["hit_rate"] * 100 for t in turns]
        mean = [rows[t]["ttft_mean_s"] * 1000 for t in turns]
        p50 = [rows[t]["ttft_p50_s"] * 1000 for t in turns]
        ax_hit.plot(x, hit, marker="o", color=colour, label=policy)
        ax_ttft.plot(x, mean, marker="o", color=colour, label=f"{policy} mean")
        ax_ttft.plot(x, p50, ls="--", marker=".", color=colour, alpha=0.7, label=f"{policy} p50")
        for xi, yi in zip(x, hit, strict=True):
            if not math.isnan(yi):
                ax_hit.annotate(
                    f"{yi:.0f}%",
                    (xi, yi),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                    color=colour,
                )
    ax_hit.set_title("token hit rate per turn (cached / prompt tokens)")
    ax_hit.set_ylabel("%")
    ax_hit.set_ylim(0, 105)
    ax_ttft.set_title("time to first token per turn")
    ax_ttft.set_ylabel("ms")
    ax_ttft.set_ylim(bottom=0)
    for ax in (ax_hit, ax_ttft):
        ax.set_xlabel("turn")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_router_matrix(workloads: Mapping[str, Mapping[str, Any]], folder: str | Path) -> list[str]:
    """One PNG per workload of ``bench_peers --engine emulated``: hit rate and TTFT per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    Path(folder).mkdir(parents=True, exist_ok=True)
    for workload, rows in workloads.items():
        routers = [r for r, v in rows.items() if "hit_rate" in v]
        fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
        x = range(len(routers))
        ax_hit.bar(x, [rows[r]["hit_rate"] * 100 for r in routers], color="C0")
        ax_hit.set_ylabel("token hit rate (%, workers' counters)")
        width = 0.4
        p50 = [rows[r]["ttft_p50_s"] * 1000 for r in routers]
        p99 = [rows[r]["ttft_p99_s"] * 1000 for r in routers]
        ax_ttft.bar([i - width / 2 for i in x], p50, width, label="p50", color="C1")
        ax_ttft.bar([i + width / 2 for i in x], p99, width, label="p99", color="C3")
        ax_ttft.set_ylabel("TTFT (ms)")
        ax_ttft.legend()
        for ax in (ax_hit, ax_ttft):
            ax.set_xticks(list(x), routers, rotation=20, ha="right", fontsize=8)
        fig.suptitle(f"{workload}: routers on one emulated fleet each")
        fig.tight_layout()
        path = Path(folder) / f"bench_peers_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths
