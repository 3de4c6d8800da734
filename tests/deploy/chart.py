"""Offline access to the kvroute Helm chart for the deploy tests.

Rendering and linting go through helm-python-sdk, which links Helm's own Go engine
(libhelm_c) into the process: the same template engine, Sprig functions and values-schema
validation as `helm template`, with no helm binary and no cluster. Paths of the files under
deploy/ that the tests read are defined here once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvroute"
DASHBOARD = CHART / "dashboards" / "kvroute.json"
RULES = CHART / "rules" / "kvroute-rules.yaml"
INTERFACES = ROOT / "docs" / "INTERFACES.md"

RELEASE = "demo"
NAMESPACE = "llm"

# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest one the
# installed kubernetes-validate ships schemas for.
KUBE_VERSIONS = ("1.27.0", "1.37.0")

# Values for the variants every render test runs; "default" is the chart as shipped.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {
        "redis": {
            "enabled": False,
            "external": {"url": "rediss://redis.cache.example:6380/2"},
            "auth": {"existingSecret": "shared-redis", "existingSecretPasswordKey": "password"},
            "namespace": "fleet-a",
        },
    },
    # Also the chart without the production defaults: no gRPC token, no Redis ACL users.
    "monitoring-off": {
        "monitoring": {"enabled": False},
        "grpcAuth": {"enabled": False},
        "redis": {"acl": {"enabled": False}},
    },
    "many-workers": {
        "worker": {
            "replicas": 16,
            "gpu": {"resourceName": "amd.com/gpu"},
            "numBlocks": 40000,
            "resources": {
                "requests": {"cpu": "12", "memory": "96Gi"},
                "limits": {"cpu": "16", "memory": "128Gi"},
            },
            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
            "tolerations": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}],
            "extraArgs": ["--some-future-flag=1"],
        },
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 4},
        "model": {"volume": {"type": "hostPath", "hostPath": "/mnt/models"}},
    },
    "cpu-download-apikeys": {
        "worker": {"device": "cpu", "dtype": "float32", "replicas": 1},
        "model": {
            "servedModelName": "smollm2",
            "volume": {"type": "emptyDir", "sizeLimit": "5Gi"},
            "download": {
                "enabled": True,
                "image": "amazon/aws-cli:2.17.0",
                "command": ["aws", "s3", "sync", "s3://models/smollm2", "/models/model"],
            },
        },
        "gateway": {
            "apiKeys": {"existingSecret": "kvroute-api-keys"},
            "tokenizer": {"source": "configMap", "configMap": "smollm2-tokenizer"},
        },
        "redis": {"persistence": {"enabled": True, "storageClass": "fast"}},
    },
    "tokenizer-init-hpa": {
        "gateway": {
            "tokenizer": {
                "source": "init",
                "init": {
                    "image": "amazon/aws-cli:2.17.0",
                    "command": ["sh", "-c", "aws s3 sync s3://tok/m $KVROUTE_TOKENIZER_PATH"],
                },
            },
            "autoscaling": {"requestMetric": {"enabled": True, "targetAverageValue": "16"}},
            "podAntiAffinity": "hard",
        },
        "worker": {"podAntiAffinity": "none"},
        "redis": {
            "auth": {"existingSecret": "", "password": "from-the-secret-store"},
            "acl": {
                "workerPassword": "worker-pw-from-store",
                "gatewayPassword": "gw-pw-from-store",
            },
        },
        "grpcAuth": {"existingSecret": "", "token": "grpc-token-from-the-store"},
    },
}


@dataclass(frozen=True)
class Manifest:
    """One rendered Kubernetes object and the template file it came from."""

    template: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])


def load_chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict[str, Any], release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would write it."""
    with load_chart() as chart:
        return chart.render(values, name=release, namespace=NAMESPACE, is_install=True)


def manifests(values: dict[str, Any], release: str = RELEASE) -> list[Manifest]:
    """Every Kubernetes object the chart renders for `values` (NOTES.txt excluded)."""
    out: list[Manifest] = []
    for template, text in sorted(render(values, release).items()):
        if not template.endswith(".yaml"):
            continue
        out.extend(Manifest(template, doc) for doc in yaml.safe_load_all(text) if doc)
    return out


def find(items: list[Manifest], kind: str, component: str) -> Manifest:
    """The single object of `kind` labelled with `component`."""
    hits = [
        m
        for m in items
        if m.kind == kind
        and m.doc["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(hits) == 1, f"expected one {kind} for {component}, got {[m.name for m in hits]}"
    return hits[0]


def redis_acl_file(dest: Path, *, namespace: str, default: str, worker: str, gateway: str) -> Path:
    """The Redis ACL file the chart's Redis pod would load, written to ``dest``.

    Renders the ACL ConfigMap for ``redis.namespace`` and runs its ``render-acl.sh`` as
    the pod's init container does (``sh``, ``sed``, ``sha256sum``) with these passwords.
    """
    items = manifests({"redis": {"namespace": namespace}})
    data = next(m for m in items if m.kind == "ConfigMap" and m.name.endswith("-redis-acl"))
    data_files = data.doc["data"]
    template = dest.with_name(dest.name + ".in")
    template.write_text(data_files["users.acl.in"])
    script = dest.with_name("render-acl.sh")
    script.write_text(data_files["render-acl.sh"])
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "ACL_TEMPLATE": str(template),
        "ACL_FILE": str(dest),
        "REDIS_PASSWORD": default,
        "WORKER_PASSWORD": worker,
        "GATEWAY_PASSWORD": gateway,
    }
    subprocess.run(["sh", str(script)], env=env, check=True, capture_output=True, timeout=30)
    return dest


def kinds(items: list[Manifest]) -> set[tuple[str, str]]:
    return {(m.kind, m.doc["metadata"]["labels"]["app.kubernetes.io/component"]) for m in items}


def promtool() -> str:
    """Path of promtool; a missing one fails the test with the install command."""
    found = shutil.which("promtool")
    assert found, (
        "promtool is missing: apt-get install -y --no-install-recommends prometheus "
        "(Debian's package ships it)"
    )
    return found


def _interface_rows() -> list[tuple[str, str, set[str]]]:
    """(name, type, labels) for each metric in the tables under "Metric names" in
    docs/INTERFACES.md. Worker metrics all carry `worker_id` (said above their table)."""
    text = INTERFACES.read_text()
    section = text[text.index("## Metric names") :]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        labels = set(re.findall(r"`([a-zA-Z_][a-zA-Z0-9_]*)`", cells[2]))
        for name in re.findall(r"`([a-zA-Z_:][a-zA-Z0-9_:]*)`", cells[0]):
            extra = {"worker_id"} if name.startswith("kvroute_worker_") else set()
            rows.append((name, cells[1], labels | extra))
    return rows


def interface_metrics() -> dict[str, str]:
    """Metric name -> type (counter, gauge, histogram) from docs/INTERFACES.md."""
    return {name: kind for name, kind, _ in _interface_rows()}


def interface_labels() -> dict[str, set[str]]:
    """Metric name -> the labels docs/INTERFACES.md gives it."""
    return {name: labels for name, _, labels in _interface_rows()}
