"""The chart's `vllm` worker kind: a vLLM server plus the `kvroute bridge` sidecar."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from contract.model_paths import served_model_name
from tests.deploy.chart import CHART, KUBE_VERSIONS, find, kinds, manifests, render
from worker.bridge.cli import config_from_args

VLLM = {
    "vllm": {
        "enabled": True,
        "replicas": 3,
        "blockSize": 16,
        "extraArgs": ["--max-model-len=8192"],
    },
    "worker": {"replicas": 0},
    "model": {"path": "/models/Llama-3.1-8B-Instruct"},
}


def _flag(args: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]


def _containers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    sts = find(manifests(values), "StatefulSet", "vllm").doc
    return {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}


def test_off_by_default() -> None:
    assert not any(c == "vllm" for _, c in kinds(manifests({})))


def test_lints_and_validates_strict() -> None:
    for kube in KUBE_VERSIONS:
        report = helm.lint(CHART, VLLM, strict=True, kube_version=f"v{kube}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], (kube, report)
    items = manifests(VLLM)
    assert {("StatefulSet", "vllm"), ("Service", "vllm")} <= kinds(items)
    for m in items:
        if m.kind in ("StatefulSet", "Service") and "vllm" in m.name:
            for kube in KUBE_VERSIONS:
                kubernetes_validate.validate(m.doc, kube, strict=True)


def test_vllm_container_publishes_kv_events_and_is_ready_on_health() -> None:
    vllm = _containers(VLLM)["vllm"]
    args = vllm["args"]
    assert _flag(args, "--model") == "/models/Llama-3.1-8B-Instruct"
    # The served name is the folder's, as kvroute's gateway and workers derive it.
    assert _flag(args, "--served-model-name") == served_model_name("/models/Llama-3.1-8B-Instruct")
    assert _flag(args, "--block-size") == "16"
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    events = json.loads(_flag(args, "--kv-events-config"))
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv",
    }
    assert "--max-model-len=8192" in args
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_bridge_sidecar_flags_parse_and_point_at_the_pod() -> None:
    bridge = _containers(VLLM)["bridge"]
    args = bridge["args"]
    assert args[0] == "bridge"
    env = {"KVROUTE_REDIS_PASSWORD": "x"}
    config, level = config_from_args(args[1:], env=env)  # the real CLI accepts every flag
    assert config.events == "tcp://127.0.0.1:5557" and config.replay == "tcp://127.0.0.1:5558"
    assert config.url == "http://127.0.0.1:8000"
    assert config.advertise_url == "http://$(KVROUTE_POD_IP):8000"
    assert config.worker_id == "$(KVROUTE_POD_NAME)"
    assert config.tokenizer == "/models/Llama-3.1-8B-Instruct"
    assert config.model_name == "Llama-3.1-8B-Instruct" and level == "INFO"
    names = {e["name"] for e in bridge["env"]}
    assert {"KVROUTE_POD_NAME", "KVROUTE_POD_IP", "KVROUTE_REDIS_PASSWORD"} <= names
    mounts = {m["name"]: m for m in bridge["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True  # the bridge reads the tokenizer files


def test_headless_service_and_replicas() -> None:
    items = manifests(VLLM)
    svc = find(items, "Service", "vllm").doc
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    sts = find(items, "StatefulSet", "vllm").doc
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == svc["metadata"]["name"]


def test_cpu_vllm_without_gpu_and_bad_heartbeats() -> None:
    values = {"vllm": {"enabled": True, "gpu": {"enabled": False}, "blockSize": 32}}
    vllm = _containers(values)["vllm"]
    assert "nvidia.com/gpu" not in vllm["resources"].get("limits", {})
    bad = {"vllm": {"enabled": True, "bridge": {"heartbeatTtl": 1.0, "heartbeatInterval": 2.0}}}
    with pytest.raises(Exception, match="heartbeatTtl"):
        render(bad)
    with pytest.raises(Exception, match=r"(?i)vllm"):
        render({"vllm": {"enabled": True, "nope": 1}})  # the values schema
