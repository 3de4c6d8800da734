"""``python -m loadtest.bench_engine`` in process, end to end on a tiny random model.

The in-process run once printed ``null``: ``run`` built its result and never
returned it, and no test ran the command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench_engine


def test_in_process_run_prints_its_figures(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_llama), "--prompt-tokens", "96", "--new-tokens", "8"]
    argv += ["--concurrency", "2", "--throughput-prompt-tokens", "16", "--max-batch-tokens", "128"]
    assert bench_engine.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # Greedy tokens equal HF generate's, and the sibling's 32 shared tokens (two
    # 16-token blocks) are what the hit found cached.
    assert out["outputs_identical"] is True
    assert out["hit_cached_tokens"] == 32
    for key in ("ttft_cold_s", "ttft_hit_s", "engine_tokens_per_s", "hf_tokens_per_s"):
        assert out[key] > 0, key
    assert out["target_met"] == (
        out["outputs_identical"]
        and out["ttft_ratio"] >= bench_engine.TTFT_RATIO_TARGET
        and out["throughput_ratio"] >= bench_engine.THROUGHPUT_RATIO_TARGET
    )
