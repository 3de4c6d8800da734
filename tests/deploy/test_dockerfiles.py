"""The two Dockerfiles, read as text (no Docker engine here): they start the `kvroute`
console script, run as a non-root user, declare a HEALTHCHECK, copy only paths that exist,
and keep torch (the [worker] extra) out of the gateway image."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.deploy.chart import DEPLOY, ROOT

DOCKER = DEPLOY / "docker"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def _last(items: list[tuple[str, str]], keyword: str) -> str:
    found = [a for k, a in items if k == keyword]
    assert found, f"no {keyword}"
    return found[-1]


def _final_stage(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (k, _) in enumerate(items) if k == "FROM"]
    return items[starts[-1] :]


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_image_runs_kvroute_as_non_root_with_healthcheck(component: str) -> None:
    items = instructions(DOCKER / f"{component}.Dockerfile")
    final = _final_stage(items)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvroute"] == "kvroute_cli:main"
    assert (ROOT / "kvroute_cli.py").is_file()
    assert _last(final, "ENTRYPOINT") == '["kvroute"]'
    assert _last(final, "CMD") == f'["{component}"]'
    user = _last(final, "USER").split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "numeric non-root USER"
    healthcheck = _last(final, "HEALTHCHECK")
    assert "CMD" in healthcheck and not healthcheck.startswith("NONE")
    probe = "/health"  # the same liveness path on gateway and worker
    assert f"{probe}'" in healthcheck
    assert any(k == "COPY" and a.startswith("--from=build") for k, a in final)


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_copied_sources_exist(component: str) -> None:
    """The build context is the repository root: every COPY source must be there."""
    for keyword, args in instructions(DOCKER / f"{component}.Dockerfile"):
        if keyword != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{component}.Dockerfile copies missing {source}"


def test_gateway_image_never_installs_torch() -> None:
    items = instructions(DOCKER / "gateway.Dockerfile")
    text = " ".join(a for _, a in items)
    assert not re.search(r"torch|\[worker\]|cuda", text, re.I)
    assert not any(k == "COPY" and "worker/" in a for k, a in items)
    installs = [a for k, a in items if k == "RUN" and "pip install" in a]
    assert installs and all(re.search(r"pip install \.(\s|$)", a) for a in installs)
    assert _last(items, "FROM").startswith("python:")
    # `pip install .` pulls the base dependencies: none of them may be torch.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"torch\b", d)]


def test_worker_image_installs_worker_extra_on_cuda() -> None:
    items = instructions(DOCKER / "worker.Dockerfile")
    base = next(a for k, a in items if k == "ARG" and a.startswith("CUDA_BASE="))
    assert base.startswith("CUDA_BASE=nvidia/cuda:") and "runtime" in base
    assert all(
        a == "${CUDA_BASE}" or a.startswith("${CUDA_BASE} ") for k, a in items if k == "FROM"
    )
    installs = " ".join(a for k, a in items if k == "RUN")
    assert '".[worker]"' in installs
    assert "torch==${TORCH_VERSION}" in installs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pinned = next(d for d in extras["worker"] if d.startswith("torch"))
    version = next(a for k, a in items if k == "ARG" and a.startswith("TORCH_VERSION="))
    assert pinned == f"torch=={version.split('=', 1)[1]}", "image torch matches pyproject's pin"


def test_parser_joins_continuations_and_drops_comments(tmp_path: Path) -> None:
    dockerfile = tmp_path / "x.Dockerfile"
    dockerfile.write_text("# c\nFROM a AS b\nRUN one \\\n    && two\n\nuser 10:10\n")
    assert instructions(dockerfile) == [
        ("FROM", "a AS b"),
        ("RUN", "one && two"),
        ("USER", "10:10"),
    ]


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = {
        line.strip()
        for line in (DOCKER / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests", "**/__pycache__"} <= patterns


FIRST_PARTY = ("contract", "openai_api", "gateway", "worker", "loadtest")


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_image_copies_every_package_its_code_imports(component: str) -> None:
    """A package the component imports but the image lacks is a crash at start-up."""
    imported = {component}
    for path in (ROOT / component).rglob("*.py"):
        for match in re.finditer(
            r"^\s*(?:from|import) (\w+)", path.read_text(encoding="utf-8"), re.M
        ):
            if match.group(1) in FIRST_PARTY:
                imported.add(match.group(1))
    copies = " ".join(a for k, a in instructions(DOCKER / f"{component}.Dockerfile") if k == "COPY")
    missing = {p for p in imported if f"{p}/ " not in copies + " "}
    assert not missing, f"{component}.Dockerfile does not COPY {sorted(missing)}"
    assert "loadtest" not in imported, f"{component} must not import loadtest"
