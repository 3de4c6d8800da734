"""Reads metric names out of PromQL text (dashboard queries, alert rules).

Not a PromQL parser: it strips what cannot be a metric name (strings, label matchers,
ranges, label lists of by/without/on/ignoring/group_*, function calls, keywords, numbers)
and keeps the identifiers left. promtool parses the same expressions for real.
"""

from __future__ import annotations

import re

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![a-zA-Z0-9_:])(?!\s*\()")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "inf", "nan"}
)
_GRAFANA_VARS = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def metric_names(expr: str) -> set[str]:
    """Every metric name selected in `expr`."""
    text = _STRINGS.sub(" ", expr)
    text = _GRAFANA_VARS.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}


def rated_metrics(expr: str) -> set[str]:
    """Metric names that appear directly inside rate(), irate() or increase()."""
    return set(re.findall(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", expr))


def substitute_grafana_vars(expr: str) -> str:
    """A plain PromQL expression from a dashboard query, for promtool to parse."""
    return (
        expr.replace("$__rate_interval", "5m")
        .replace("$window", "5m")
        .replace("${window}", "5m")
        .replace("$worker", ".*")
        .replace("${worker}", ".*")
    )
