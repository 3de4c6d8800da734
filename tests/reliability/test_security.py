"""Security on a real fleet: API keys, per-tenant cache isolation, a password-protected
Redis, a shared gRPC token between gateway and workers, and no secret in any process's log.

One worker and one gateway on the tiny Llama, against a ``redis-server
--requirepass`` this module starts; the password reaches both through the Redis URL,
the keys reach the gateway through ``--api-keys-file`` and both get the same
``--grpc-token-file``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from contract import worker_pb2, worker_pb2_grpc
from contract.redis_layout import RedisLayout
from loadtest.fleet import Fleet, FleetConfig
from tests.reliability.fleetkit import call, is_openai_error, wait_for
from tests.support import RedisProcess

pytestmark = pytest.mark.slow

REDIS_PASSWORD = "redis-pw-7f3a9c1e55d04b2a"
KEYS = {"sk-alpha-0c8e4f1d2b7a4e6f9a31": "alpha", "sk-beta-5d2c9e7a1f3b4c8d0e62": "beta"}
ALPHA, BETA = list(KEYS)
NAMESPACE = "kvsecure"
GRPC_TOKEN = "grpc-tok-3b8e1f0c9d2a4e7f6a5b"


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
    secrets_dir = tmp_path_factory.mktemp("keys")
    keys_file = secrets_dir / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    token_file = secrets_dir / "grpc-token"
    token_file.write_text(GRPC_TOKEN + "\n")  # as `echo` writes it: the newline is dropped
    config = FleetConfig(
        model=str(tiny_llama),
        workers=1,
        redis_url=secure_redis.url,
        namespace=NAMESPACE,
        num_blocks=256,
        worker_args=("--grpc-token-file", str(token_file)),
        gateway_args=(
            "--api-keys-file",
            str(keys_file),
            "--grpc-token-file",
            str(token_file),
            "--log-level",
            "debug",
        ),
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


def _raw_request(port: int, head: bytes) -> bytes:
    """Sends ``head`` as a request's header block on a fresh connection; returns the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n" + head + b"\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("front", ["gateway", "worker-0"])
@pytest.mark.parametrize(
    "header",
    [b"Authorization: Bearer %s" + b"x" * 9000, b"Authorization: Bearer %s\x01"],
    ids=["over-long", "bad-byte"],
)
def test_a_refused_authorization_header_is_not_logged(
    fleet: Fleet, logs: Path, header: bytes, front: str
) -> None:
    """aiohttp quotes the first 100 bytes of an over-long header (or the bytes around a bad
    one) when its parser refuses a request; the gateway and the worker's HTTP front log
    that they refused, not what."""
    if front == "gateway":
        port, url = fleet.gateway_port, fleet.gateway_url
    else:
        port, url = fleet.workers[0].http_port, fleet.workers[0].http_url
    log = logs / f"{front}.log"
    before = log.read_text(errors="replace").count("refused an unparsable request")
    reply = _raw_request(port, header.replace(b"%s", ALPHA.encode()))
    assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n", 1)[0], reply[:80]
    text = wait_for(
        lambda: (
            (t := log.read_text(errors="replace")).count("refused an unparsable request") > before
            and t
        ),
        5,
        f"{front} logged the refused request",
    )
    assert ALPHA not in text and ALPHA[:12] not in text
    assert "Traceback" not in text.split("refused an unparsable request")[-1][:2000]
    assert call(url + "/health").status == 200  # and it serves on


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
        leaks += [
            (f.name, secret[:8]) for secret in (REDIS_PASSWORD, GRPC_TOKEN, *KEYS) if secret in text
        ]
    assert not leaks, f"secrets in logs: {leaks}"


def model_name_with_key(fleet: Fleet) -> str:
    reply = call(fleet.gateway_url + "/v1/models", headers=_bearer(ALPHA))
    assert reply.status == 200
    return str(reply.body["data"][0]["id"])


# -- the gRPC token between gateway and workers ------------------------------------------

WRONG_CREDENTIALS = [
    None,
    ("authorization", "Bearer wrong-token-0000000000000"),
    ("authorization", f"Bearer {GRPC_TOKEN[:-1]}"),
    ("authorization", f"Basic {GRPC_TOKEN}"),
    ("authorization", GRPC_TOKEN),
    ("x-kvroute-token", GRPC_TOKEN),
]


def _grpc_stub(fleet: Fleet) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{fleet.workers[0].grpc_port}")
    return channel, worker_pb2_grpc.WorkerStub(channel)


@pytest.mark.parametrize("pair", WRONG_CREDENTIALS, ids=lambda p: "none" if p is None else p[1])
def test_worker_grpc_refuses_calls_without_the_token(
    fleet: Fleet, pair: tuple[str, str] | None
) -> None:
    metadata = None if pair is None else (pair,)
    channel, stub = _grpc_stub(fleet)
    with channel:
        with pytest.raises(grpc.RpcError) as health:
            stub.Health(worker_pb2.HealthRequest(), metadata=metadata, timeout=10)
        assert health.value.code() == grpc.StatusCode.UNAUTHENTICATED
        request = worker_pb2.GenerateRequest(
            request_id="probe",
            prompt_token_ids=[1, 2, 3, 4],
            sampling=worker_pb2.SamplingParams(max_tokens=2),
        )
        with pytest.raises(grpc.RpcError) as generate:
            list(stub.Generate(request, metadata=metadata, timeout=10))
        assert generate.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in (generate.value.details() or "")


def test_worker_grpc_serves_the_right_token(fleet: Fleet) -> None:
    channel, stub = _grpc_stub(fleet)
    with channel:
        reply = stub.Health(
            worker_pb2.HealthRequest(),
            metadata=(("authorization", f"Bearer {GRPC_TOKEN}"),),
            timeout=10,
        )
    assert reply.serving


def test_gateway_with_the_token_serves_a_chat(fleet: Fleet) -> None:
    model = model_name_with_key(fleet)
    reply = call(
        fleet.gateway_url + "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        headers=_bearer(ALPHA),
    )
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["message"]["role"] == "assistant"
    assert reply.body["usage"]["completion_tokens"] >= 1


def test_tenant_probe_through_the_worker_port_needs_the_token(fleet: Fleet) -> None:
    """Issue 14 item 6: confirm a tenant's prompt by sending it straight to a worker's
    HTTP front, trying cache_salt guesses. Without the token every try is a 401."""
    model = model_name_with_key(fleet)
    secret = "alpha's secret number is 48151623 and it is long enough to fill blocks " * 2
    body = {"model": model, "prompt": secret, "max_tokens": 1}
    seeded = call(fleet.gateway_url + "/v1/completions", body, headers=_bearer(ALPHA))
    assert seeded.status == 200, seeded.body
    worker = fleet.workers[0].http_url
    probes = [{**body, "cache_salt": salt} for salt in ("", "alpha", "sk-alpha", "beta")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, _bearer(ALPHA)):
        for probe in probes:
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
                reply = call(worker + path, probe, headers=headers)
                assert reply.status == 401, (path, headers, reply.body)
                assert is_openai_error(reply.body)
                assert reply.headers.get("www-authenticate") == "Bearer"
        for path in ("/get_load", "/v1/models"):
            assert call(worker + path, headers=headers).status == 401
    # Kubelet probes and the Prometheus scrape carry no token and stay open.
    for path in ("/health", "/healthz", "/readyz", "/metrics"):
        assert call(worker + path).status == 200, path
    # A holder of the token (a router of this fleet) with a guessed salt still shares no
    # block with the tenant: its salt is an HMAC under the gateway's secret.
    routed = call(
        worker + "/v1/completions", probes[1], headers={"Authorization": f"Bearer {GRPC_TOKEN}"}
    )
    assert routed.status == 200, routed.body
    assert routed.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
