"""probe_thread_handoff on a tiny run: both loops measured, every hand-off timed."""

from __future__ import annotations

import json

import pytest

from loadtest import probe_thread_handoff


def test_both_loops_report_both_waits(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe_thread_handoff.main(["--jobs", "3", "--busy-ms", "0.2", "--sleep-ms", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) == {"uvloop", "asyncio"}
    for loop in out["results"].values():
        figures = loop["sleep_1ms"]
        assert 0 <= figures["start_wait_p50_ms"] <= figures["start_wait_p90_ms"]
        assert figures["start_wait_p90_ms"] <= figures["start_wait_max_ms"]
        assert 0 <= figures["return_wait_p50_ms"] <= figures["return_wait_p90_ms"]
