"""What each component of the rendered Helm chart is wired with: the worker StatefulSet
(GPU, advertised pod IP, drain grace, probes, volumes), the gateway Deployment (flags,
probes, autoscaling, tokenizer without the model volume, affinity), their Services and
budgets, and the monitoring objects. The checks over every variant are
``test_chart_render``."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.deploy.chart import DASHBOARD, RULES, VARIANTS, find, manifests
from tests.deploy.manifest_parts import CRD_GROUP, flag, gateway_pod


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
    assert flag(args, "--advertise-host") == "$(KVROUTE_POD_IP)"
    assert env["KVROUTE_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert flag(args, "--worker-id") == "$(KVROUTE_POD_NAME)"
    # A SIGTERMed worker drains for exactly as long as Kubernetes waits before SIGKILL.
    assert flag(args, "--drain-grace-s") == str(pod["terminationGracePeriodSeconds"])
    assert env["KVROUTE_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flag(args, "--device") == "cuda"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--memory-fraction") == "0.9"
    assert not any(a.startswith("--num-blocks=") for a in args)
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {
        "grpc": int(flag(args, "--grpc-port")),
        "http": int(flag(args, "--http-port")),
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
    assert flag(worker["args"], "--num-blocks") == "40000"
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
    assert flag(pod["containers"][0]["args"], "--served-model-name") == "smollm2"

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
        "--shared-fill-gain",
        "--session-ttl",
        "--stream-interval",
        "--replica-sync",
        "--processes",
        "--max-queue-per-worker",
        "--log-level",
        "--grpc-token-file",
    }
    assert config["KVROUTE_POLICY"] == "kvroute" and config["KVROUTE_PORT"] == "8000"
    assert config["KVROUTE_SHARED_FILL_GAIN"] == "3"
    # Replicas share routing and relay streams at the auto interval unless told otherwise.
    assert (config["KVROUTE_STREAM_INTERVAL"], config["KVROUTE_REPLICA_SYNC"]) == ("0", "true")
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


@pytest.mark.parametrize("name", ["cpu-download-apikeys", "tokenizer-init-hpa"])
def test_gateway_tokenizer_without_the_model_volume(name: str) -> None:
    items = manifests(VARIANTS[name])
    pod = gateway_pod(items)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "model" not in volumes, "the gateway must not mount the model volume"
    (gateway,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    model = find(items, "ConfigMap", "gateway").doc["data"]["KVROUTE_MODEL"]
    assert mounts["tokenizer"] == model == "/tokenizer/model"
    # Same last path segment as the workers' --model: both derive the same served name.
    worker = find(items, "StatefulSet", "worker").doc["spec"]["template"]["spec"]["containers"][0]
    assert flag(worker["args"], "--model").rsplit("/", 1)[-1] == "model"
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
    pod = gateway_pod(manifests({}))
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
    gateway = gateway_pod(items)
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
    hard = gateway_pod(items)["affinity"]["podAntiAffinity"]
    assert list(hard) == ["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "affinity" not in find(items, "StatefulSet", "worker").doc["spec"]["template"]["spec"]
    custom = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["llm"]}]}]
    }}}  # fmt: skip
    pod = gateway_pod(manifests({"gateway": {"affinity": custom}}))
    assert pod["affinity"] == custom
