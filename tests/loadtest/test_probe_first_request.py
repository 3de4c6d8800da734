"""probe_first_request end to end on a tiny run: a real gateway, every request timed."""

from __future__ import annotations

import json

import pytest

from loadtest import probe_first_request

pytestmark = pytest.mark.timeout(180)


def test_the_probe_times_each_request_against_a_real_gateway(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert probe_first_request.main(["--workers", "1", "--requests", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["latencies_ms"]) == 3 and all(x > 0 for x in out["latencies_ms"])
    assert out["first_ms"] == pytest.approx(out["latencies_ms"][0], abs=1e-3)
    assert out["first_over_rest"] == pytest.approx(out["first_ms"] / out["rest_p50_ms"])


def test_a_probe_of_one_request_is_refused() -> None:
    with pytest.raises(SystemExit):
        probe_first_request.main(["--requests", "1"])
