"""The routing sweep end to end on a small slice: its JSON, and baselines that must match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import sweep
from loadtest.fleetsim import SIM_POLICIES

SLICE = ["--workloads", "mooncake_32", "--fleet-sizes", "4", "--limit", "60"]


def test_sweep_slice_reports_every_cell_and_policy_with_spread_arrivals(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    assert sweep.main([*SLICE, "--trace-arrivals", "spread", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trace_arrivals"] == "spread"
    assert result["cells_total"] == len(result["cells"]) == 4  # 2 rates x 2 capacities
    for cell in result["cells"]:
        assert cell["requests"] == 60
        assert set(cell["policies"]) == set(SIM_POLICIES)
        hit = (
            cell["policies"]["kvroute"]["hit_rate"]
            - cell["policies"][cell["best_hit_baseline"]]["hit_rate"]
        )
        assert cell["hit_margin"] == pytest.approx(hit)
    assert result["cells_passing"] == sum(c["passes"] for c in result["cells"])


def test_spread_arrivals_change_the_replay_but_not_the_requests() -> None:
    w = sweep.WORKLOADS["mooncake_32"]
    recorded = sweep.shapes_for(w, 4.0, 60, 0)
    spread = sweep.shapes_for(w, 4.0, 60, 0, spread=True)
    assert [s.block_keys for s in spread] == [s.block_keys for s in recorded]
    assert len({s.arrival_s for s in spread}) > len({s.arrival_s for s in recorded})


def test_baselines_of_the_other_arrivals_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "recorded.json"
    assert sweep.main([*SLICE, "--workloads", "mooncake_32", "--json", str(out)]) == 0
    with pytest.raises(ValueError, match="--trace-arrivals"):
        sweep.main([*SLICE, "--trace-arrivals", "spread", "--baselines", str(out)])
