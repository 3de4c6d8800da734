"""The Helm chart lints clean, renders for every variant, and what it renders is valid
Kubernetes (kubernetes-validate --strict) with no secret in plain sight, every argument
variable defined and every container unprivileged. Each component's own wiring is
``test_chart_components``."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.chart import (
    CHART,
    KUBE_VERSIONS,
    VARIANTS,
    Manifest,
    find,
    kinds,
    manifests,
)
from tests.deploy.manifest_parts import CRD_GROUP, containers, flag, workloads

BASE_KINDS = {
    ("ServiceAccount", "kvroute"),
    ("ConfigMap", "gateway"),
    ("Deployment", "gateway"),
    ("Service", "gateway"),
    ("HorizontalPodAutoscaler", "gateway"),
    ("PodDisruptionBudget", "gateway"),
    ("StatefulSet", "worker"),
    ("Service", "worker"),
    ("PodDisruptionBudget", "worker"),
}
# The Redis password is an existing Secret by default; the chart makes one only from
# `redis.auth.password`. The ConfigMap holds the ACL rules (redis.acl, on by default).
REDIS_KINDS = {("StatefulSet", "redis"), ("Service", "redis"), ("ConfigMap", "redis")}
MONITORING_KINDS = {
    ("ServiceMonitor", "gateway"),
    ("PodMonitor", "worker"),
    ("PrometheusRule", "monitoring"),
    ("ConfigMap", "monitoring"),
}
EXPECTED_KINDS = {
    "default": BASE_KINDS | REDIS_KINDS | MONITORING_KINDS,
    "external-redis": BASE_KINDS | MONITORING_KINDS,
    "monitoring-off": BASE_KINDS | (REDIS_KINDS - {("ConfigMap", "redis")}),
    "many-workers": (BASE_KINDS - {("HorizontalPodAutoscaler", "gateway")})
    | REDIS_KINDS
    | MONITORING_KINDS,
    "cpu-download-apikeys": BASE_KINDS | REDIS_KINDS | MONITORING_KINDS,
    "tokenizer-init-hpa": BASE_KINDS
    | REDIS_KINDS
    | {("Secret", "redis"), ("Secret", "grpc-token")}
    | MONITORING_KINDS,
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    return request.param, manifests(VARIANTS[request.param])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_chart_lints_clean(name: str) -> None:
    for kube in KUBE_VERSIONS:
        report = helm.lint(CHART, VARIANTS[name], strict=True, kube_version=f"v{kube}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], (kube, report)


def test_variant_renders_expected_objects(variant: tuple[str, list[Manifest]]) -> None:
    name, items = variant
    assert kinds(items) == EXPECTED_KINDS[name]
    names = [(m.kind, m.name) for m in items]
    assert len(names) == len(set(names)), "two objects share a kind and name"


def test_manifests_pass_kubernetes_validate_strict(variant: tuple[str, list[Manifest]]) -> None:
    _, items = variant
    checked = 0
    for m in items:
        if m.doc["apiVersion"] == CRD_GROUP:
            continue
        for kube in KUBE_VERSIONS:
            kubernetes_validate.validate(m.doc, kube, strict=True)
            checked += 1
    assert checked >= 2 * 9


def test_strict_validation_rejects_unknown_fields() -> None:
    """The validator in strict mode is really strict: one misspelt field fails it."""
    deployment = find(manifests({}), "Deployment", "gateway").doc
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_redis_password_only_from_a_secret(variant: tuple[str, list[Manifest]]) -> None:
    name, items = variant
    external = name == "external-redis"
    chart_secret = name == "tokenizer-init-hpa"  # redis.auth.password given
    acl = name not in ("external-redis", "monitoring-off")  # redis.acl on (the default)
    secret_name = {True: "demo-kvroute-redis", False: "kvroute-redis"}[chart_secret]
    secret_name = "shared-redis" if external else secret_name
    secret_key = "password" if external else "redis-password"
    for m in workloads(items):
        for c in containers(m):
            for e in c.get("env", []):
                assert not ("PASSWORD" in e["name"] or "AUTH" in e["name"]) or "value" not in e, (
                    f"{m.name}/{c['name']} sets {e['name']} as a plain value"
                )
    for component in ("gateway", "worker"):
        m = find(items, "Deployment" if component == "gateway" else "StatefulSet", component)
        env = {e["name"]: e for e in m.doc["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["KVROUTE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        # With ACLs each role has its own user and password, in the same Secret.
        key = f"{component}-password" if acl else secret_key
        assert ref == {"name": secret_name, "key": key}
    url = find(items, "ConfigMap", "gateway").doc["data"]["KVROUTE_REDIS_URL"]
    worker = find(items, "StatefulSet", "worker").doc["spec"]["template"]["spec"]["containers"][0]
    worker_url = flag(worker["args"], "--redis-url")
    for u in (url, worker_url):
        assert urlsplit(u).password is None, u
    if external:
        assert url == worker_url == "rediss://redis.cache.example:6380/2"
        assert flag(worker["args"], "--redis-namespace") == "fleet-a"
    else:
        if acl:
            assert url == "redis://kvroute-gateway@demo-kvroute-redis:6379/0"
            assert worker_url == "redis://kvroute-worker@demo-kvroute-redis:6379/0"
        else:
            assert url == worker_url == "redis://demo-kvroute-redis:6379/0"
        if chart_secret:
            secret = find(items, "Secret", "redis").doc
            assert secret["data"]["redis-password"] == "ZnJvbS10aGUtc2VjcmV0LXN0b3Jl"
            assert set(secret["data"]) == {"redis-password", "worker-password", "gateway-password"}
        redis = find(items, "StatefulSet", "redis").doc["spec"]["template"]["spec"]
        args = redis["containers"][0]["args"]
        if acl:  # the default user's password is in the ACL file, as a hash
            assert "--requirepass" not in args
            assert args[args.index("--aclfile") + 1] == "/run/redis-acl/users.acl"
        else:
            assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
        assert redis["securityContext"]["runAsNonRoot"] is True


def test_every_arg_variable_is_defined(variant: tuple[str, list[Manifest]]) -> None:
    """A $(VAR) the kubelet cannot resolve reaches the CLI verbatim: every one must exist."""
    _, items = variant
    configmaps = {m.name: m.doc.get("data", {}) for m in items if m.kind == "ConfigMap"}
    used = 0
    for m in workloads(items):
        for c in containers(m):
            defined = {e["name"] for e in c.get("env", [])}
            for source in c.get("envFrom", []):
                defined |= set(configmaps[source["configMapRef"]["name"]])
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in defined, f"{m.name}/{c['name']}: $({var}) is not defined"
                    used += 1
    assert used >= 10


def test_containers_run_unprivileged(variant: tuple[str, list[Manifest]]) -> None:
    _, items = variant
    for m in workloads(items):
        pod = m.doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for c in containers(m):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (m.name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (m.name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_longest_release_name_gives_valid_names() -> None:
    """Helm allows 53-character release names; every name must still fit a DNS label, and a
    StatefulSet's name plus its revision-hash suffix (11 characters) must fit a label value."""
    helm.validate_release_name("r" * 53)
    items = manifests({}, release="r" * 53)
    for m in items:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m.name) and len(m.name) <= 63
        if m.kind == "StatefulSet":
            assert len(m.name) + 11 <= 63, m.name


def test_redis_secret_is_stable_without_lookup() -> None:
    """The same values give the same Secret on every render (helm template, Argo CD)."""
    values = VARIANTS["tokenizer-init-hpa"]
    first = find(manifests(values), "Secret", "redis").doc
    assert find(manifests(values), "Secret", "redis").doc == first
    for template in (CHART / "templates").iterdir():
        assert not re.search(r"\blookup\s", template.read_text()), template.name
