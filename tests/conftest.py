"""Shared fixtures: a real Redis, tiny real checkpoints, the real SmolLM2."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import RedisProcess, env_redis_url

# The tests run several workers (and this process's own torch) on a few shared cores:
# OpenMP threads must sleep between parallel regions, not spin, or each process takes
# the others' cores (loadtest.fleet does the same for co-located workers). Every
# process a test spawns inherits this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis for the whole session: ``KVROUTE_TEST_REDIS_URL``, a container, or a local binary."""
    url = env_redis_url()
    if url:
        yield url
        return
    if _docker_answers():
        try:
            from testcontainers.redis import RedisContainer
        except ImportError:
            pass
        else:
            with RedisContainer("redis:7") as container:
                host = container.get_container_host_ip()
                yield f"redis://{host}:{container.get_exposed_port(6379)}/0"
            return
    proc = RedisProcess().start()
    try:
        yield proc.url
    finally:
        proc.close()


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A private Redis this test may kill and restart (fault tests)."""
    proc = RedisProcess().start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder, converted once into the cache dir."""
    from tests.models import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each tiny architecture in turn."""
    from tests.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
