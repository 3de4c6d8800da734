"""Reading the parts of rendered chart objects that the chart tests check.

Shared by ``test_chart_render`` (every variant) and ``test_chart_components``
(each component's wiring): a workload's containers, the workloads among the
objects, the one value of a ``--flag=value`` argument, the gateway's pod spec.
"""

from __future__ import annotations

from typing import Any

from tests.deploy.chart import Manifest, find

# prometheus-operator kinds: kubernetes-validate ships schemas for built-in kinds only and no
# CRD schema is available offline, so these are checked structurally (test_monitors_*).
CRD_GROUP = "monitoring.coreos.com/v1"


def containers(m: Manifest) -> list[dict[str, Any]]:
    """A workload's init containers and containers."""
    spec = m.doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def workloads(items: list[Manifest]) -> list[Manifest]:
    """The Deployments and StatefulSets among ``items``."""
    return [m for m in items if m.kind in ("Deployment", "StatefulSet")]


def flag(args: list[str], name: str) -> str:
    """The value of the flag ``name`` given once, as ``name=value``, in ``args``."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


def gateway_pod(items: list[Manifest]) -> dict[str, Any]:
    """The gateway Deployment's pod spec."""
    return find(items, "Deployment", "gateway").doc["spec"]["template"]["spec"]
