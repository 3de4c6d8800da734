"""The Helm chart lints clean, renders for every variant, and what it renders is valid
Kubernetes (kubernetes-validate --strict) wired the way kvroute needs it."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    DASHBOARD,
    KUBE_VERSIONS,
    RULES,
    VARIANTS,
    Manifest,
    find,
    kinds,
    manifests,
)

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

# prometheus-operator kinds: kubernetes-validate ships schemas for built-in kinds only and no
# CRD schema is available offline, so these are checked structurally (test_monitors_*).
CRD_GROUP = "monitoring.coreos.com/v1"


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    return request.param, manifests(VARIANTS[request.param])


def _containers(m: Manifest) -> list[dict[str, Any]]:
    spec = m.doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def _workloads(items: list[Manifest]) -> list[Manifest]:
    return [m for m in items if m.kind in ("Deployment", "StatefulSet")]


def _flag(args: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]


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


def test_worker_statefulset_one_gpu_each_and_pod_ip_advertised() -> None:
    items = manifests({})
    sts = find(items, "StatefulSet", "worker").doc
    pod = sts["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    env = {e["name"]: e for e in worker["env"]}
    args = worker["args"]
    assert args[0] == "worker"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    # The gateway dials the address a worker advertises: its own pod IP.
    assert _flag(args, "--advertise-host") == "$(KVROUTE_POD_IP)"
    assert env["KVROUTE_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert _flag(args, "--worker-id") == "$(KVROUTE_POD_NAME)"
    # A SIGTERMed worker drains for exactly as long as Kubernetes waits before SIGKILL.
    assert _flag(args, "--drain-grace-s") == str(pod["terminationGracePeriodSeconds"])
    assert env["KVROUTE_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert _flag(args, "--device") == "cuda"
    assert _flag(args, "--dtype") == "bfloat16"
    assert _flag(args, "--memory-fraction") == "0.9"
    assert not any(a.startswith("--num-blocks=") for a in args)
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {
        "grpc": int(_flag(args, "--grpc-port")),
        "http": int(_flag(args, "--http-port")),
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert worker["startupProbe"]["failureThreshold"] * 10 == 1800
    assert {v["name"] for v in pod["volumes"]} == {"model", "tmp", "dshm", "grpc-token"}
    mounts = {v["name"]: v for v in worker["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert mounts["dshm"]["mountPath"] == "/dev/shm" and mounts["tmp"]["mountPath"] == "/tmp"
    assert pod["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "kvroute-models",
        "readOnly": True,
    }
    headless = find(items, "Service", "worker").doc
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_many_workers_take_custom_resources_and_gpu_kind() -> None:
    items = manifests(VARIANTS["many-workers"])
    sts = find(items, "StatefulSet", "worker").doc
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    assert sts["spec"]["replicas"] == 16
    assert worker["resources"] == {
        "requests": {"cpu": "12", "memory": "96Gi"},
        "limits": {"cpu": "16", "memory": "128Gi", "amd.com/gpu": 1},
    }
    assert _flag(worker["args"], "--num-blocks") == "40000"
    assert not any(a.startswith("--memory-fraction=") for a in worker["args"])
    assert worker["args"][-1] == "--some-future-flag=1"
    volume = sts["spec"]["template"]["spec"]["volumes"][0]
    assert volume["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    assert find(items, "Deployment", "gateway").doc["spec"]["replicas"] == 4


def test_cpu_worker_download_and_api_keys() -> None:
    items = manifests(VARIANTS["cpu-download-apikeys"])
    sts = find(items, "StatefulSet", "worker").doc
    pod = sts["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    (init,) = pod["initContainers"]
    assert init["image"] == "amazon/aws-cli:2.17.0"
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert pod["volumes"][0]["emptyDir"] == {"sizeLimit": "5Gi"}
    assert _flag(pod["containers"][0]["args"], "--served-model-name") == "smollm2"

    gateway = find(items, "Deployment", "gateway").doc["spec"]["template"]["spec"]
    config = find(items, "ConfigMap", "gateway").doc["data"]
    keys_file = config["KVROUTE_API_KEYS_FILE"]
    assert "--api-keys-file=$(KVROUTE_API_KEYS_FILE)" in gateway["containers"][0]["args"]
    mount = next(v for v in gateway["containers"][0]["volumeMounts"] if v["name"] == "api-keys")
    assert keys_file == f"{mount['mountPath']}/api-keys"
    secret = next(v for v in gateway["volumes"] if v["name"] == "api-keys")["secret"]
    assert secret["secretName"] == "kvroute-api-keys"
    # Tenant salts are an HMAC under a key from the same Secret, never plain env.
    env = {e["name"]: e for e in gateway["containers"][0]["env"]}
    ref = env["KVROUTE_TENANT_SALT_SECRET"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("kvroute-api-keys", "tenant-salt-secret")
    redis = find(items, "StatefulSet", "redis").doc
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast"
    assert "--appendonly" in redis["spec"]["template"]["spec"]["containers"][0]["args"]


def test_redis_password_only_from_a_secret(variant: tuple[str, list[Manifest]]) -> None:
    name, items = variant
    external = name == "external-redis"
    chart_secret = name == "tokenizer-init-hpa"  # redis.auth.password given
    acl = name not in ("external-redis", "monitoring-off")  # redis.acl on (the default)
    secret_name = {True: "demo-kvroute-redis", False: "kvroute-redis"}[chart_secret]
    secret_name = "shared-redis" if external else secret_name
    secret_key = "password" if external else "redis-password"
    for m in _workloads(items):
        for c in _containers(m):
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
    worker_url = _flag(worker["args"], "--redis-url")
    for u in (url, worker_url):
        assert urlsplit(u).password is None, u
    if external:
        assert url == worker_url == "rediss://redis.cache.example:6380/2"
        assert _flag(worker["args"], "--redis-namespace") == "fleet-a"
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
    for m in _workloads(items):
        for c in _containers(m):
            defined = {e["name"] for e in c.get("env", [])}
            for source in c.get("envFrom", []):
                defined |= set(configmaps[source["configMapRef"]["name"]])
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in defined, f"{m.name}/{c['name']}: $({var}) is not defined"
                    used += 1
    assert used >= 10


def test_gateway_deployment_flags_probes_and_scaling() -> None:
    items = manifests({})
    deployment = find(items, "Deployment", "gateway").doc
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    config = find(items, "ConfigMap", "gateway").doc["data"]
    assert gateway["args"][0] == "gateway"
    flags = {a.split("=", 1)[0] for a in gateway["args"][1:]}
    assert flags == {
        "--model",
        "--redis-url",
        "--redis-namespace",
        "--host",
        "--port",
        "--policy",
        "--balance-factor",
        "--recompute-weight",
        "--session-ttl",
        "--max-queue-per-worker",
        "--log-level",
        "--grpc-token-file",
    }
    assert config["KVROUTE_POLICY"] == "kvroute" and config["KVROUTE_PORT"] == "8000"
    assert gateway["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    hpa = find(items, "HorizontalPodAutoscaler", "gateway").doc["spec"]
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert "torch" not in json.dumps(deployment)


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_selectors_match_pods(component: str) -> None:
    items = manifests({})
    kind = "Deployment" if component == "gateway" else "StatefulSet"
    pod_labels = find(items, kind, component).doc["spec"]["template"]["metadata"]["labels"]
    service = find(items, "Service", component).doc
    pdb = find(items, "PodDisruptionBudget", component).doc
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    other = "worker" if component == "gateway" else "gateway"
    other_kind = "StatefulSet" if other == "worker" else "Deployment"
    other_labels = find(items, other_kind, other).doc["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= other_labels.items()


def test_monitors_select_the_right_targets_and_job_names() -> None:
    """Structural check of the CRD objects: selectors, ports and the job names the alert
    rules query (job="kvroute-gateway" / job="kvroute-worker")."""
    items = manifests({"monitoring": {"labels": {"release": "prom"}}})
    rules = RULES.read_text()
    service = find(items, "Service", "gateway").doc
    monitor = find(items, "ServiceMonitor", "gateway").doc
    assert monitor["apiVersion"] == CRD_GROUP
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    assert f'job="{job}"' in rules and job == "kvroute-gateway"

    pod = find(items, "StatefulSet", "worker").doc["spec"]["template"]
    podmonitor = find(items, "PodMonitor", "worker").doc
    assert (
        podmonitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    (endpoint,) = podmonitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    job = pod["metadata"]["labels"][podmonitor["spec"]["jobLabel"]]
    assert f'job="{job}"' in rules and job == "kvroute-worker"
    for m in (monitor, podmonitor):
        assert m["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}


def test_prometheusrule_is_the_rule_file() -> None:
    rule = find(manifests({}), "PrometheusRule", "monitoring").doc
    assert rule["apiVersion"] == CRD_GROUP
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"}
            assert r["expr"].strip() and ("alert" in r) != ("record" in r)


def test_dashboard_configmap_carries_the_dashboard() -> None:
    items = manifests({"monitoring": {"dashboards": {"namespace": "grafana"}}})
    configmap = find(items, "ConfigMap", "monitoring").doc
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "grafana"
    assert json.loads(configmap["data"]["kvroute.json"]) == json.loads(DASHBOARD.read_text())


def test_containers_run_unprivileged(variant: tuple[str, list[Manifest]]) -> None:
    _, items = variant
    for m in _workloads(items):
        pod = m.doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for c in _containers(m):
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


def _gateway_pod(items: list[Manifest]) -> dict[str, Any]:
    return find(items, "Deployment", "gateway").doc["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", ["cpu-download-apikeys", "tokenizer-init-hpa"])
def test_gateway_tokenizer_without_the_model_volume(name: str) -> None:
    items = manifests(VARIANTS[name])
    pod = _gateway_pod(items)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "model" not in volumes, "the gateway must not mount the model volume"
    (gateway,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    model = find(items, "ConfigMap", "gateway").doc["data"]["KVROUTE_MODEL"]
    assert mounts["tokenizer"] == model == "/tokenizer/model"
    # Same last path segment as the workers' --model: both derive the same served name.
    worker = find(items, "StatefulSet", "worker").doc["spec"]["template"]["spec"]["containers"][0]
    assert _flag(worker["args"], "--model").rsplit("/", 1)[-1] == "model"
    if name == "cpu-download-apikeys":
        assert volumes["tokenizer"]["configMap"] == {"name": "smollm2-tokenizer"}
        assert "initContainers" not in pod  # the model download is the workers' business
    else:
        assert "sizeLimit" in volumes["tokenizer"]["emptyDir"]
        (init,) = pod["initContainers"]
        assert init["name"] == "tokenizer-fetch"
        env = {e["name"]: e["value"] for e in init["env"]}
        assert env["KVROUTE_TOKENIZER_PATH"] == "/tokenizer/model"
        assert {m["name"] for m in init["volumeMounts"]} == {"tokenizer", "tmp"}


def test_default_gateway_mounts_the_model_volume_read_only() -> None:
    pod = _gateway_pod(manifests({}))
    assert {v["name"] for v in pod["volumes"]} >= {"model"}
    (gateway,) = pod["containers"]
    assert {m["name"]: m.get("readOnly") for m in gateway["volumeMounts"]}["model"] is True


def test_hpa_scales_on_requests_in_flight_when_asked() -> None:
    default = find(manifests({}), "HorizontalPodAutoscaler", "gateway").doc["spec"]["metrics"]
    assert [m["type"] for m in default] == ["Resource"]
    items = manifests(VARIANTS["tokenizer-init-hpa"])
    metrics = find(items, "HorizontalPodAutoscaler", "gateway").doc["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Resource", "Pods"]
    assert metrics[1]["pods"] == {
        "metric": {"name": "kvroute_gateway_inflight_requests"},
        "target": {"type": "AverageValue", "averageValue": "16"},
    }


def test_anti_affinity_presets_and_topology_spread() -> None:
    items = manifests({})
    gateway = _gateway_pod(items)
    worker = find(items, "StatefulSet", "worker").doc["spec"]["template"]["spec"]
    for pod, component in ((gateway, "gateway"), (worker, "worker")):
        (term,) = pod["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == component
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    (spread,) = gateway["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert "topologySpreadConstraints" not in worker
    items = manifests(VARIANTS["tokenizer-init-hpa"])
    hard = _gateway_pod(items)["affinity"]["podAntiAffinity"]
    assert list(hard) == ["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "affinity" not in find(items, "StatefulSet", "worker").doc["spec"]["template"]["spec"]
    custom = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["llm"]}]}]
    }}}  # fmt: skip
    pod = _gateway_pod(manifests({"gateway": {"affinity": custom}}))
    assert pod["affinity"] == custom
