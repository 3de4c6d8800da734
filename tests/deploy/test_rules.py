"""promtool accepts the alert rules and every dashboard query, and the alerts fire (and stay
quiet) on synthetic histories exactly as kvroute-rules.test.yaml expects."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.deploy.chart import RULES, promtool
from tests.deploy.promql import substitute_grafana_vars
from tests.deploy.test_metric_names import dashboard_exprs

HERE = Path(__file__).resolve().parent


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=30, check=False
    )


def test_promtool_check_rules_passes() -> None:
    result = _run("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout + result.stderr


def test_alerts_fire_on_their_unit_histories() -> None:
    result = _run("test", "rules", HERE / "kvroute-rules.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = yaml.safe_load((HERE / "kvroute-rules.test.yaml").read_text())
    alerts = {t["alertname"] for case in tested["tests"] for t in case["alert_rule_test"]}
    defined = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert alerts == defined, "every alert has a unit test"


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum(rate(a[5m])\n"
    )
    assert _run("check", "rules", broken).returncode != 0


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses each dashboard query (Grafana variables filled in) as a recording rule."""
    exprs = [substitute_grafana_vars(e) for e in dashboard_exprs()]
    rules = [{"record": f"kvroute_dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _run("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout + result.stderr
