"""No dashboard panel or alert can point at nothing: every metric they query is
exported by a real gateway and a real worker, scraped after one request."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from loadtest.fleet import Fleet, FleetConfig
from tests.deploy.promql import metric_names
from tests.deploy.test_metric_names import PROMETHEUS_SERIES, dashboard_exprs, rule_exprs

_TYPE = re.compile(r"^# TYPE (\S+) (\w+)$", re.M)


def exported(text: str) -> set[str]:
    """Every series name a scrape of this exposition can yield (from its # TYPE lines)."""
    names: set[str] = set()
    for name, kind in _TYPE.findall(text):
        if kind == "counter":
            names |= {name, f"{name}_total"}
        elif kind == "histogram":
            names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_dashboard_and_alert_metrics_exist_on_live_processes(tiny_llama: Path) -> None:
    config = FleetConfig(model=str(tiny_llama), workers=1, num_blocks=256, startup_timeout=120)
    with Fleet(config) as fleet:
        model = json.loads(_get(f"{fleet.gateway_url}/v1/models"))["data"][0]["id"]
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        ).encode()
        request = urllib.request.Request(
            f"{fleet.gateway_url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
        live = exported(_get(f"{fleet.gateway_url}/metrics"))
        live |= exported(_get(f"{fleet.workers[0].http_url}/metrics"))
    wanted: set[str] = set()
    for expr in dashboard_exprs() + rule_exprs():
        wanted |= metric_names(expr)
    wanted -= PROMETHEUS_SERIES
    assert len(wanted) >= 20, wanted
    assert not wanted - live, f"queried but not exported: {sorted(wanted - live)}"
