"""gateway_memory: a real gateway in front of the instant fakes, its RSS before and after."""

from __future__ import annotations

import json

import pytest

from loadtest import gateway_memory


def test_a_short_run_reports_the_gateways_memory_and_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        gateway_memory.main(["--workload", "chat_small", "--seconds", "2", "--concurrency", "4"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    (run,) = out["runs"]
    assert run["requests"] > 10 and run["rps"] == round(run["requests"] / 2, 1)
    # A Python gateway with a tokenizer loaded holds tens of MB at least.
    assert 30 < run["rss_mb_before"] <= run["rss_mb_after"] + 64
    assert out["workload"] == "chat_small" and out["command"].startswith("python -m loadtest")
