"""Who may talk to whom in the chart: the gRPC token mounted into gateways and workers, and
the Redis ACL users (rules in a ConfigMap, password hashes written at Redis start-up)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from tests.deploy.chart import VARIANTS, Manifest, find, manifests, redis_acl_file

TOKEN_PATH = "/etc/kvroute/grpc-token/token"


def _pod(items: list[Manifest], kind: str, component: str) -> dict[str, Any]:
    return dict(find(items, kind, component).doc["spec"]["template"]["spec"])


def _token_volume(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in pod["volumes"] if v["name"] == "grpc-token"), None)


def test_grpc_token_reaches_gateway_and_worker_by_default() -> None:
    items = manifests({})
    worker_pod, gateway_pod = (
        _pod(items, "StatefulSet", "worker"),
        _pod(items, "Deployment", "gateway"),
    )
    (worker,), (gateway,) = worker_pod["containers"], gateway_pod["containers"]
    assert f"--grpc-token-file={TOKEN_PATH}" in worker["args"]
    assert "--grpc-token-file=$(KVROUTE_GRPC_TOKEN_FILE)" in gateway["args"]
    config = find(items, "ConfigMap", "gateway").doc["data"]
    assert config["KVROUTE_GRPC_TOKEN_FILE"] == TOKEN_PATH
    for pod, container in ((worker_pod, worker), (gateway_pod, gateway)):
        volume = _token_volume(pod)
        assert volume is not None and volume["secret"] == {
            "secretName": "kvroute-grpc-token",
            "defaultMode": 0o440,
            "items": [{"key": "token", "path": "token"}],
        }
        mount = next(m for m in container["volumeMounts"] if m["name"] == "grpc-token")
        assert mount == {
            "name": "grpc-token",
            "mountPath": "/etc/kvroute/grpc-token",
            "readOnly": True,
        }
        # The token never appears in an env value or an argument.
        assert all("value" not in e for e in container["env"] if "TOKEN" in e["name"])
    # Probes carry no token: they must hit the worker's open paths.
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health"


def test_grpc_token_off_and_chart_created() -> None:
    off = manifests(VARIANTS["monitoring-off"])  # grpcAuth.enabled false
    for kind, component in (("StatefulSet", "worker"), ("Deployment", "gateway")):
        pod = _pod(off, kind, component)
        assert _token_volume(pod) is None
        assert not any("grpc-token" in a for a in pod["containers"][0]["args"])
    assert "KVROUTE_GRPC_TOKEN_FILE" not in find(off, "ConfigMap", "gateway").doc["data"]
    made = manifests(VARIANTS["tokenizer-init-hpa"])  # existingSecret "" + token
    secret = find(made, "Secret", "grpc-token").doc
    assert base64.b64decode(secret["data"]["token"]).decode() == "grpc-token-from-the-store"
    volume = _token_volume(_pod(made, "StatefulSet", "worker"))
    assert volume is not None and volume["secret"]["secretName"] == secret["metadata"]["name"]


def test_redis_acl_pod_renders_the_file_from_secrets() -> None:
    items = manifests({})
    pod = _pod(items, "StatefulSet", "redis")
    (init,) = pod["initContainers"]
    assert init["command"] == ["sh", "/etc/redis-acl/render-acl.sh"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"] if "valueFrom" in e}
    assert refs == {
        "REDIS_PASSWORD": {"name": "kvroute-redis", "key": "redis-password"},
        "WORKER_PASSWORD": {"name": "kvroute-redis", "key": "worker-password"},
        "GATEWAY_PASSWORD": {"name": "kvroute-redis", "key": "gateway-password"},
    }
    (redis,) = pod["containers"]
    assert "REDIS_PASSWORD" not in {e["name"] for e in redis["env"]}  # only the hash is used
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["acl"]["emptyDir"]["medium"] == "Memory"
    acl_map = find(items, "ConfigMap", "redis")
    assert volumes["acl-template"]["configMap"]["name"] == acl_map.name
    annotations = find(items, "StatefulSet", "redis").doc["spec"]["template"]["metadata"]
    assert "checksum/acl" in annotations["annotations"]


def test_redis_acl_rules_per_role(tmp_path: Path) -> None:
    acl = redis_acl_file(
        tmp_path / "users.acl",
        namespace="fleet-b",
        default="d" * 20,
        worker="w" * 20,
        gateway="g" * 20,
    )
    users = {line.split()[1]: line.split()[2:] for line in acl.read_text().splitlines()}
    assert set(users) == {"default", "kvroute-worker", "kvroute-gateway"}
    sha = {
        u: "#" + hashlib.sha256(c.encode() * 20).hexdigest()
        for u, c in (("default", "d"), ("kvroute-worker", "w"), ("kvroute-gateway", "g"))
    }
    for user, rules in users.items():
        assert rules[0] == "on" and rules[1] == sha[user]
    worker, gateway = users["kvroute-worker"], users["kvroute-gateway"]
    assert (
        "~fleet-b:*" in worker
        and "-@all" in worker
        and not any("@" in r and r.startswith("+") for r in worker)
    )
    assert "%R~fleet-b:*" in gateway and "+@read" in gateway
    assert not any(r.lstrip("+") in ("hset", "sadd", "del") for r in gateway)
    # Its one write: XADD, to the replicas' routes stream only.
    assert "+xadd" in gateway
    assert [r for r in gateway if "~" in r] == ["%R~fleet-b:*", "~fleet-b:routes"]


def test_the_frames_port_opens_only_without_the_grpc_token() -> None:
    # It checks no token: with grpcAuth (the default) gateways stay on gRPC.
    def worker(values: dict[str, Any]) -> tuple[list[str], list[str]]:
        (container,) = _pod(manifests(values), "StatefulSet", "worker")["containers"]
        return container["args"], [p["name"] for p in container["ports"]]

    args, ports = worker({})
    assert not any(a.startswith("--frames-port") for a in args) and "frames" not in ports
    args, ports = worker({"grpcAuth": {"enabled": False}})
    assert "--frames-port=50052" in args and "frames" in ports
    args, ports = worker({"grpcAuth": {"enabled": False}, "worker": {"framesPort": 0}})
    assert not any(a.startswith("--frames-port") for a in args) and "frames" not in ports
