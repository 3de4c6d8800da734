"""Every metric the dashboard and the alert rules query is one docs/INTERFACES.md promises,
used the way its type allows (rate() on counters, _bucket on histograms)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.chart import DASHBOARD, RULES, interface_labels, interface_metrics
from tests.deploy.promql import metric_names, rated_metrics

# Series Prometheus writes itself for every scrape target.
PROMETHEUS_SERIES = {"up"}
# Labels Prometheus (or the operator's monitors) attach to every scraped series.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if var["type"] == "query":
            # label_values(metric, label): only the first argument is a metric.
            match = re.fullmatch(r"label_values\(\s*([^,]+),\s*\w+\s*\)", query)
            assert match, f"unexpected variable query {query!r}"
            exprs.append(match.group(1))
    return exprs


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def _contract_name(name: str, metrics: dict[str, str]) -> str | None:
    """The INTERFACES.md name `name` belongs to, or None."""
    if name in metrics:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and metrics.get(base) == "histogram":
            return base
    return None


def test_interfaces_tables_are_read() -> None:
    metrics = interface_metrics()
    assert metrics["kvroute_worker_cached_prompt_tokens_total"] == "counter"
    assert metrics["kvroute_worker_waiting"] == "gauge"  # from the "running / waiting" row
    assert metrics["kvroute_gateway_ttft_seconds"] == "histogram"
    assert len(metrics) >= 25


def test_extractor_finds_exactly_the_metric_names() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, worker) (rate(kvroute_gateway_ttft_seconds_bucket"
        '{worker=~"$worker", le!="x"}[$window]))) > bool 1e3 and on (namespace) up offset 5m '
        '/ ignoring(code) label_replace(foo:bar, "a", "$1", "b", "(.*)")'
    )
    assert metric_names(expr) == {"kvroute_gateway_ttft_seconds_bucket", "up", "foo:bar"}
    assert rated_metrics(expr) == {"kvroute_gateway_ttft_seconds_bucket"}


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_metric_used_is_in_interfaces(source: str) -> None:
    metrics = interface_metrics()
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    unknown = {n for n in used - PROMETHEUS_SERIES if _contract_name(n, metrics) is None}
    assert unknown == set(), f"{source} uses metrics docs/INTERFACES.md does not list"
    assert len(used) >= (25 if source == "dashboard" else 8)


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_rate_only_over_counters_and_histograms(source: str) -> None:
    metrics = interface_metrics()
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    for expr in exprs:
        for name in rated_metrics(expr):
            base = _contract_name(name, metrics)
            assert base is not None, name
            if metrics[base] == "histogram":
                assert name.endswith("_bucket") or name.endswith(("_sum", "_count")), name
            else:
                assert metrics[base] == "counter", f"rate() over gauge {name}"
    for expr in exprs:
        for name in metric_names(expr):
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr, f"{name} outside histogram_quantile"


def test_dashboard_covers_every_interface_metric() -> None:
    """The dashboard is the place an operator looks first: nothing the code exports is hidden."""
    metrics = interface_metrics()
    used = {_contract_name(n, metrics) for e in dashboard_exprs() for n in metric_names(e)}
    assert set(metrics) - used == set()


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_label_matchers_use_the_metrics_own_labels(source: str) -> None:
    """Every series names the worker `worker_id`; a matcher on a label a metric does not
    have silently selects nothing."""
    metrics, labels = interface_metrics(), interface_labels()
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    checked = 0
    for expr in exprs:
        for name, matchers in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^{}]*)\}", expr):
            base = _contract_name(name, metrics)
            allowed = TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
            allowed |= labels.get(base, set()) if base else set()
            used = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
            assert used <= allowed, f"{name}{{{matchers}}}: {used - allowed} unknown"
            checked += 1
        # Grouping labels must exist on some metric of the same expression.
        known = TARGET_LABELS | {"le"}
        for name in metric_names(expr):
            base = _contract_name(name, metrics)
            known |= labels.get(base, set()) if base else set()
        for group in re.findall(r"\b(?:by|on)\s*\(([^()]*)\)", expr):
            grouped = {g.strip() for g in group.split(",") if g.strip()}
            assert grouped <= known, f"groups by unknown {grouped - known} in {expr!r}"
    assert checked >= (20 if source == "dashboard" else 2)
