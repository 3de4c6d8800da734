"""values.yaml is fully documented and values.schema.json rejects bad values before anything
renders (Helm validates the schema on every install, upgrade and template)."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.chart import CHART, render

# (values, a fragment the error must contain): each one is a mistake a user could make.
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"gatewy": {"replicas": 2}}, "additional properties 'gatewy'"),
    ({"gateway": {"replicas": "two"}}, "/gateway/replicas"),
    ({"gateway": {"policy": "fastest"}}, "/gateway/policy"),
    ({"gateway": {"balanceFactor": 0.5}}, "/gateway/balanceFactor"),
    ({"gateway": {"port": 70000}}, "/gateway/port"),
    ({"worker": {"device": "tpu"}}, "/worker/device"),
    ({"worker": {"memoryFraction": 1.5}}, "/worker/memoryFraction"),
    ({"worker": {"blockSize": 0}}, "/worker/blockSize"),
    ({"worker": {"shmSize": "lots"}}, "/worker/shmSize"),
    ({"worker": {"gpu": {"resourceName": "gpu"}}}, "/worker/gpu/resourceName"),
    ({"worker": {"podDisruptionBudget": {"maxUnavailable": "half"}}}, "maxUnavailable"),
    ({"monitoring": {"interval": "15 seconds"}}, "/monitoring/interval"),
    ({"redis": {"enabled": False}}, "/redis/external/url"),
    (
        {
            "redis": {
                "enabled": False,
                "external": {"url": "redis://r:6379/0"},
                "auth": {"existingSecret": ""},
            }
        },
        "/redis/auth/existingSecret",
    ),
    # A password inside the URL would land in a ConfigMap and in the pod spec.
    (
        {
            "redis": {
                "enabled": False,
                "external": {"url": "redis://:hunter2@r:6379/0"},
                "auth": {"existingSecret": "s"},
            }
        },
        "/redis/external/url",
    ),
    ({"redis": {"external": {"url": "http://r:6379"}}}, "/redis/external/url"),
    ({"model": {"volume": {"type": "hostPath"}}}, "/model/volume/hostPath"),
    ({"model": {"volume": {"type": "s3"}}}, "/model/volume/type"),
    ({"model": {"download": {"enabled": True}}}, "/model/download/image"),
    ({"model": {"path": "models/x"}}, "/model/path"),
    ({"gateway": {"tokenizer": {"source": "hub"}}}, "/gateway/tokenizer/source"),
    ({"gateway": {"tokenizer": {"source": "configMap"}}}, "/gateway/tokenizer/configMap"),
    ({"gateway": {"tokenizer": {"source": "init"}}}, "/gateway/tokenizer/init/image"),
    ({"gateway": {"podAntiAffinity": "maybe"}}, "/gateway/podAntiAffinity"),
    ({"worker": {"podAntiAffinity": True}}, "/worker/podAntiAffinity"),
    (
        {"gateway": {"autoscaling": {"requestMetric": {"targetAverageValue": "lots"}}}},
        "targetAverageValue",
    ),
    # Neither an existing Secret nor a password: nothing stable to put in the Secret.
    ({"redis": {"auth": {"existingSecret": ""}}}, "/redis/auth/password"),
    # The same for the ACL users' passwords and the gRPC token.
    (
        {"redis": {"auth": {"existingSecret": "", "password": "p"}}},
        "/redis/acl/workerPassword",
    ),
    ({"grpcAuth": {"existingSecret": ""}}, "/grpcAuth/token"),
    ({"grpcAuth": {"existingSecret": "", "token": "short"}}, "/grpcAuth/token"),
    (
        {"grpcAuth": {"existingSecret": "", "token": "has spaces in it, sixteen+"}},
        "/grpcAuth/token",
    ),
    ({"grpcAuth": {"enabled": "yes"}}, "/grpcAuth/enabled"),
]


@pytest.mark.parametrize(("values", "fragment"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_schema_rejects_bad_values(values: dict[str, Any], fragment: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        (
            {"gateway": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
            "minReplicas must not exceed",
        ),
        ({"worker": {"heartbeatInterval": 5, "heartbeatTtl": 2}}, "heartbeatTtl must be longer"),
    ],
)
def test_templates_reject_contradictory_values(values: dict[str, Any], fragment: str) -> None:
    """What a JSON schema cannot compare (one field against another) the templates check."""
    with pytest.raises(helm.HelmRenderError) as caught:
        render(values)
    assert fragment in str(caught.value)


# Definitions that mirror a Kubernetes type: values.yaml shows only part of them.
KUBERNETES_SHAPES = {"resources"}


def _schema_paths(node: dict[str, Any], defs: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        ref = child.get("$ref", "").rsplit("/", 1)[-1]
        if ref in KUBERNETES_SHAPES:
            continue
        target = defs[ref] if ref else child
        if target.get("additionalProperties") is False:
            paths |= _schema_paths(target, defs, path + ".")
    return paths


def _value_paths(node: Any, schema_paths: set[str], prefix: str = "") -> set[str]:
    paths = set()
    if isinstance(node, dict):
        for key, child in node.items():
            path = f"{prefix}{key}"
            paths.add(path)
            # Descend only where the schema describes the children (not into free maps).
            if any(p.startswith(path + ".") for p in schema_paths):
                paths |= _value_paths(child, schema_paths, path + ".")
    return paths


def test_schema_describes_exactly_the_values() -> None:
    """No knob in values.yaml that the schema does not check, and none in the schema that
    values.yaml does not show (ignoring `global`, which Helm injects)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema_paths = _schema_paths(schema, schema["definitions"]) - {"global"}
    assert _value_paths(values, schema_paths) == schema_paths


def _undocumented(node: yaml.Node, lines: list[str], prefix: str = "") -> list[str]:
    missing: list[str] = []
    if not isinstance(node, yaml.MappingNode):
        return missing
    for key, child in node.value:
        path = f"{prefix}{key.value}"
        # The comment block right above the key (helm-docs reads `# --` there).
        above, line = [], key.start_mark.line - 1
        while line >= 0 and lines[line].strip().startswith("#"):
            above.append(lines[line].strip())
            line -= 1
        documented = any(c.startswith("# --") for c in above)
        if not documented:
            if isinstance(child, yaml.MappingNode) and child.value:
                missing += _undocumented(child, lines, path + ".")
            else:
                missing.append(path)
    return missing


def test_every_value_is_documented() -> None:
    text = (CHART / "values.yaml").read_text()
    root = yaml.compose(text)
    assert _undocumented(root, text.splitlines()) == []


def test_documentation_check_catches_a_bare_key() -> None:
    text = "a:\n  # -- documented\n  b: 1\n  c: 2\n# -- whole map\nd:\n  e: 1\n"
    assert _undocumented(yaml.compose(text), text.splitlines()) == ["a.c"]
