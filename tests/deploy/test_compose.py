"""compose.yaml is a valid Compose file (the Compose specification's JSON schema, as shipped
in the docker-compose package) and its parts fit together: every mounted file exists, ports
are published on loopback only, environment variables are real kvroute flags, Prometheus
scrapes the ports the services listen on under the job names the alert rules use, and
Grafana provisions the shipped dashboard. No Docker engine answers here; `docker compose
up` is the README's command for a machine with one."""

from __future__ import annotations

import json
import re
import subprocess
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.chart import DEPLOY, ROOT, RULES, promtool

COMPOSE = ROOT / "compose.yaml"
SERVICES = {"redis", "worker-0", "worker-1", "gateway", "prometheus", "grafana"}


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _schema() -> dict[str, Any]:
    spec = find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, (
        "the Compose schema comes from docker-compose: pip install --no-deps docker-compose"
    )
    path = Path(next(iter(spec.submodule_search_locations))) / "config" / "compose_spec.json"
    return json.loads(path.read_text())


def test_compose_file_matches_the_compose_schema() -> None:
    validator = jsonschema.Draft201909Validator(_schema())
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_schema_check_catches_a_mistake() -> None:
    broken = _compose()
    broken["services"]["gateway"]["ports"] = [{"published": "8000", "bogus": 1}]
    assert list(jsonschema.Draft201909Validator(_schema()).iter_errors(broken))


def test_fleet_shape_and_loopback_ports() -> None:
    services = _compose()["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    built = {s["build"]["dockerfile"] for s in services.values() if "build" in s}
    assert built == {"deploy/docker/worker.Dockerfile", "deploy/docker/gateway.Dockerfile"}
    assert all((ROOT / path).is_file() for path in built)


def test_mounted_files_exist() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            if isinstance(volume, str) and volume.startswith("./"):
                assert (ROOT / volume.split(":")[0]).exists(), f"{name}: {volume}"


def _flags(module: str) -> set[str]:
    from gateway.cli import build_parser as gateway_parser
    from worker.serve.config import build_parser as worker_parser

    parser = gateway_parser() if module == "gateway" else worker_parser()
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.parametrize("service", ["worker-0", "worker-1", "gateway"])
def test_environment_names_real_flags(service: str) -> None:
    spec = _compose()["services"][service]
    flags = _flags("gateway" if service == "gateway" else "worker")
    for key in spec["environment"]:
        flag = "--" + key.removeprefix("KVROUTE_").lower().replace("_", "-")
        assert key.startswith("KVROUTE_") and flag in flags, f"{service}: {key}"
    assert spec["command"][0] == ("gateway" if service == "gateway" else "worker")


def test_prometheus_scrapes_what_the_services_listen_on(tmp_path: Path) -> None:
    services = _compose()["services"]
    config = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    assert jobs["kvroute-gateway"] == [
        f"gateway:{services['gateway']['environment']['KVROUTE_PORT']}"
    ]
    assert sorted(jobs["kvroute-worker"]) == [
        f"{w}:{services[w]['environment']['KVROUTE_HTTP_PORT']}" for w in ("worker-0", "worker-1")
    ]
    # The alert rules select exactly these job names.
    assert set(re.findall(r'job="([^"]+)"', RULES.read_text())) <= set(jobs)
    # promtool accepts the config with the rules where the container mounts them.
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / RULES.name).write_text(RULES.read_text())
    config["rule_files"] = [str(rules / "*.yaml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [promtool(), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisions_the_shipped_dashboard() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    provisioning = ROOT / next(s for s, t in mounts.items() if t == "/etc/grafana/provisioning")
    provider = yaml.safe_load((provisioning / "dashboards" / "kvroute.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    source = ROOT / next(s for s, t in mounts.items() if t == path)
    assert (source / "kvroute.json").is_file()
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/kvroute.json"
