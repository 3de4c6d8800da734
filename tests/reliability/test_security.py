"""Security on a real fleet: API keys, per-tenant cache isolation, a password-protected
Redis, and no secret in any process's log.

One worker and one gateway on the tiny Llama, against a ``redis-server
--requirepass`` this module starts; the password reaches both through the Redis URL
and the keys reach the gateway through ``--api-keys-file``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from contract.redis_layout import RedisLayout
from loadtest.fleet import Fleet, FleetConfig
from tests.reliability.fleetkit import call, is_openai_error
from tests.support import RedisProcess

pytestmark = pytest.mark.slow

REDIS_PASSWORD = "redis-pw-7f3a9c1e55d04b2a"
KEYS = {"sk-alpha-0c8e4f1d2b7a4e6f9a31": "alpha", "sk-beta-5d2c9e7a1f3b4c8d0e62": "beta"}
ALPHA, BETA = list(KEYS)
NAMESPACE = "kvsecure"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security-logs")


@pytest.fixture(scope="module")
def secure_redis() -> Iterator[RedisProcess]:
    proc = RedisProcess(password=REDIS_PASSWORD).start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="module")
def fleet(
    tiny_llama: Path,
    secure_redis: RedisProcess,
    logs: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    config = FleetConfig(
        model=str(tiny_llama),
        workers=1,
        redis_url=secure_redis.url,
        namespace=NAMESPACE,
        num_blocks=256,
        gateway_args=("--api-keys-file", str(keys_file), "--log-level", "debug"),
        log_dir=str(logs),
    )
    with Fleet(config) as f:
        yield f


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_redis_requires_the_password(fleet: Fleet, secure_redis: RedisProcess) -> None:
    # No client-side retries: an auth failure must surface at once.
    no_retry = {"port": secure_redis.port, "retry": Retry(NoBackoff(), 0)}
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(**no_retry).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(password="wrong", **no_retry).ping()
    authed = redis.Redis.from_url(secure_redis.url)
    # Both processes got in with the password from the URL: the worker registered.
    assert authed.exists(RedisLayout(NAMESPACE).worker(fleet.workers[0].worker_id))
    assert call(fleet.gateway_url + "/readyz").body["healthy_workers"] == 1


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-not-a-key"},
        {"Authorization": f"Basic {ALPHA}"},
        {"Authorization": f"Bearer {ALPHA[:-1]}"},
        {"Authorization": "Bearer "},
    ],
)
def test_requests_without_a_valid_key_get_401(fleet: Fleet, headers: dict[str, str]) -> None:
    for path, body in (
        ("/v1/models", None),
        ("/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "a"}]}),
    ):
        reply = call(fleet.gateway_url + path, body, headers=headers)
        assert reply.status == 401, (path, reply.body)
        assert is_openai_error(reply.body)
        assert reply.body["error"]["type"] == "authentication_error"
        assert reply.headers.get("www-authenticate") == "Bearer"
    # Probes and metrics stay open to the platform.
    assert call(fleet.gateway_url + "/healthz").status == 200


def test_tenants_never_share_cached_blocks(fleet: Fleet) -> None:
    models = call(fleet.gateway_url + "/v1/models", headers=_bearer(ALPHA))
    assert models.status == 200
    body = {
        "model": models.body["data"][0]["id"],
        "prompt": "the same long shared prompt for both tenants " * 8,
        "max_tokens": 2,
    }

    def cached(key: str) -> int:
        reply = call(fleet.gateway_url + "/v1/completions", body, headers=_bearer(key))
        assert reply.status == 200, reply.body
        assert reply.body["usage"]["prompt_tokens"] >= 48
        return int(reply.body["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(ALPHA) == 0
    assert cached(ALPHA) > 0  # within one tenant the prefix is reused
    assert cached(BETA) == 0  # same prompt, other tenant: nothing shared
    assert cached(BETA) > 0


def test_no_secret_in_any_log(fleet: Fleet, logs: Path) -> None:
    # Traffic first, so request paths have logged whatever they log.
    model = model_name_with_key(fleet)
    call(fleet.gateway_url + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1})
    reply = call(
        fleet.gateway_url + "/v1/completions",
        {"model": model, "prompt": "log me", "max_tokens": 2},
        headers=_bearer(BETA),
    )
    assert reply.status == 200
    files = sorted(logs.glob("*.log"))
    assert {f.name for f in files} >= {"gateway.log", "worker-0.log"}
    leaks = []
    for f in files:
        text = f.read_text(errors="replace")
        assert text, f"{f.name} is empty: the check would prove nothing"
        leaks += [(f.name, secret[:8]) for secret in (REDIS_PASSWORD, *KEYS) if secret in text]
    assert not leaks, f"secrets in logs: {leaks}"


def model_name_with_key(fleet: Fleet) -> str:
    reply = call(fleet.gateway_url + "/v1/models", headers=_bearer(ALPHA))
    assert reply.status == 200
    return str(reply.body["data"][0]["id"])
