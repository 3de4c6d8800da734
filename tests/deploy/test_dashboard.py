"""The Grafana dashboard shows what operators of a cache-aware router need, and each panel's
legend only names labels its query keeps."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.deploy.chart import DASHBOARD

# (what the panel shows, a pattern one of its queries must match)
REQUIRED = [
    (
        "token hit rate per worker as rate(cached)/rate(prompt) over the window",
        r"sum by \(worker_id\) \(rate\(kvroute_worker_cached_prompt_tokens_total\{[^}]*\}"
        r"\[\$window\]\)\)\s*/ sum by \(worker_id\) \(rate\(kvroute_worker_prompt_tokens_total",
    ),
    (
        "predicted hit rate per worker (gateway)",
        r"by \(worker_id\) \(rate\(kvroute_gateway_predicted_cached_tokens_total.*"
        r"/ sum by \(worker_id\) \(rate\(kvroute_gateway_prompt_tokens_total",
    ),
    (
        "actual hit rate per worker (gateway)",
        r"by \(worker_id\) \(rate\(kvroute_gateway_cached_tokens_total.*"
        r"/ sum by \(worker_id\) \(rate\(kvroute_gateway_prompt_tokens_total",
    ),
    ("routing reason mix", r"sum by \(reason\) \(rate\(kvroute_gateway_requests_total"),
    ("TTFT p50", r"histogram_quantile\(0\.5, .*kvroute_gateway_ttft_seconds_bucket"),
    ("TTFT p95", r"histogram_quantile\(0\.95, .*kvroute_gateway_ttft_seconds_bucket"),
    ("TTFT p99", r"histogram_quantile\(0\.99, .*kvroute_gateway_ttft_seconds_bucket"),
    ("running per worker", r"by \(worker_id\) \(kvroute_worker_running"),
    ("waiting per worker", r"by \(worker_id\) \(kvroute_worker_waiting"),
    ("queued prefill per worker", r"by \(worker_id\) \(kvroute_worker_queued_prefill_tokens"),
    ("KV blocks used + free (a partition)", r'kvroute_worker_blocks\{[^}]*state=~"used\|free"'),
    ("cached blocks per worker", r"by \(worker_id\) \(kvroute_worker_cached_blocks"),
    ("evictions per second", r"rate\(kvroute_worker_evictions_total"),
    ("index event lag", r"kvroute_gateway_index_event_lag_seconds"),
    ("healthy workers", r"kvroute_gateway_healthy_workers"),
    ("in flight per worker", r"by \(worker_id\) \(kvroute_gateway_worker_inflight"),
    ("generated tokens per second", r"rate\(kvroute_gateway_generation_tokens_total"),
    ("requests in flight (autoscaling metric)", r"kvroute_gateway_inflight_requests"),
]


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets() -> list[dict[str, Any]]:
    return [t for p in _dashboard()["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize(("what", "pattern"), REQUIRED, ids=[w for w, _ in REQUIRED])
def test_dashboard_has_panel(what: str, pattern: str) -> None:
    assert any(re.search(pattern, t["expr"], re.S) for t in _targets()), what


def test_legends_name_only_kept_labels() -> None:
    for t in _targets():
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
            assert re.search(rf"by \([^)]*\b{label}\b", t["expr"]), (label, t["expr"])


def test_dashboard_is_portable() -> None:
    """Loads into any Grafana: data source by variable, unique ids and refIds, no overlap."""
    dashboard = _dashboard()
    assert dashboard["uid"] == "kvroute-overview" and dashboard["title"] == "kvroute"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {o["value"] for o in variables["window"]["options"]} >= {"5m"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)) and all(
                t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]
            )
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
