"""Redis ACLs as the chart sets them up, on a real fleet: workers write, gateways only read.

The ACL file is the one the chart renders (``tests.deploy.chart.redis_acl_file`` runs the
Redis pod's own render script), loaded by a private ``redis-server --aclfile``. The worker
connects as ``kvroute-worker`` and the gateway as ``kvroute-gateway``, each with its own
password in the URL, as the chart's ``KVROUTE_REDIS_PASSWORD`` would give them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from contract.redis_layout import RedisLayout
from loadtest.fleet import Fleet, FleetConfig
from tests.deploy.chart import redis_acl_file
from tests.reliability.fleetkit import call, model_name, wait_for
from tests.support import RedisProcess

pytestmark = pytest.mark.slow

NAMESPACE = "kvacl"
LAYOUT = RedisLayout(NAMESPACE)
PASSWORDS = {
    "default": "admin-pw-5e0d1c7b9a3f42e8",
    "kvroute-worker": "worker-pw-8c2f6a1d0b9e4d73",
    "kvroute-gateway": "gateway-pw-1a7e3c9f5b0d4e26",
}


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    acl = redis_acl_file(
        tmp_path_factory.mktemp("acl") / "users.acl",
        namespace=NAMESPACE,
        default=PASSWORDS["default"],
        worker=PASSWORDS["kvroute-worker"],
        gateway=PASSWORDS["kvroute-gateway"],
    )
    text = acl.read_text()
    assert not any(pw in text for pw in PASSWORDS.values()), "the ACL file holds hashes only"
    proc = RedisProcess(extra_args=("--aclfile", str(acl))).start()
    try:
        yield proc
    finally:
        proc.close()


def _url(proc: RedisProcess, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{proc.port}/0"


def _client(proc: RedisProcess, user: str | None) -> redis.Redis:
    if user is None:
        return redis.Redis(port=proc.port, retry=Retry(NoBackoff(), 0))
    return redis.Redis.from_url(_url(proc, user), retry=Retry(NoBackoff(), 0))


@pytest.fixture(scope="module")
def fleet(
    tiny_llama: Path, acl_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    config = FleetConfig(
        model=str(tiny_llama),
        workers=1,
        redis_url=_url(acl_redis, "kvroute-gateway"),  # what the gateway is given
        namespace=NAMESPACE,
        num_blocks=256,
        worker_args=("--redis-url", _url(acl_redis, "kvroute-worker")),  # the last one wins
        log_dir=str(tmp_path_factory.mktemp("acl-logs")),
    )
    with Fleet(config) as f:
        yield f


def test_worker_user_registers_and_publishes(fleet: Fleet, acl_redis: RedisProcess) -> None:
    admin = _client(acl_redis, "default")
    wid = fleet.workers[0].worker_id
    assert admin.exists(LAYOUT.worker(wid)) and admin.sismember(LAYOUT.workers, wid)
    events_before = admin.xlen(LAYOUT.events(wid))
    reply = call(
        fleet.gateway_url + "/v1/completions",
        {"model": model_name(fleet), "prompt": "blocks for the index " * 8, "max_tokens": 2},
    )
    assert reply.status == 200, reply.body
    # The new blocks reach Redis through the worker user: set and stream both grow.
    wait_for(lambda: admin.xlen(LAYOUT.events(wid)) > events_before, 10, "a new event batch")
    assert admin.hlen(LAYOUT.blocks(wid)) > 0
    log = Path(fleet.config.log_dir, f"{wid}.log").read_text()
    assert "registered" in log and "NOPERM" not in log and "unavailable" not in log


def test_gateway_user_routes_from_what_it_reads(fleet: Fleet) -> None:
    model = model_name(fleet)
    body = {"model": model, "prompt": "a prompt the gateway routes twice " * 8, "max_tokens": 2}
    first = call(fleet.gateway_url + "/v1/completions", body)
    second = call(fleet.gateway_url + "/v1/completions", body)
    assert first.status == second.status == 200, (first.body, second.body)
    assert second.body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert call(fleet.gateway_url + "/readyz").body["healthy_workers"] == 1
    log = Path(fleet.config.log_dir, "gateway.log").read_text()
    assert "NOPERM" not in log and "cannot reach redis" not in log.lower()


ROGUE_RECORD = {"worker_id": "rogue", "address": "127.0.0.1:1", "model": "x", "block_size": "16"}


def test_rogue_writes_as_the_gateway_user_are_refused(
    fleet: Fleet, acl_redis: RedisProcess
) -> None:
    gw = _client(acl_redis, "kvroute-gateway")
    real = fleet.workers[0].worker_id
    writes = [
        lambda: gw.hset(LAYOUT.worker("rogue"), mapping=ROGUE_RECORD),
        lambda: gw.sadd(LAYOUT.workers, "rogue"),
        lambda: gw.hset(LAYOUT.worker(real), "prefill_tokens_per_s", "nan"),
        lambda: gw.delete(LAYOUT.worker(real)),
        lambda: gw.xadd(LAYOUT.events(real), {"b": b"forged"}),
        lambda: gw.execute_command("FLUSHALL"),
    ]
    for write in writes:
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    assert gw.hgetall(LAYOUT.worker(real))  # reading is what it may do
    assert gw.xadd(LAYOUT.routes, {"g": "probe"})  # ... and telling its peers what it routed
    admin = _client(acl_redis, "default")
    assert not admin.exists(LAYOUT.worker("rogue"))
    assert admin.smembers(LAYOUT.workers) == {real.encode()}
    assert admin.hget(LAYOUT.worker(real), "prefill_tokens_per_s") != b"nan"


def test_worker_user_is_confined_to_the_fleet_keys(acl_redis: RedisProcess) -> None:
    worker = _client(acl_redis, "kvroute-worker")
    refused = [
        lambda: worker.hset("other-fleet:worker:{x}", mapping=ROGUE_RECORD),
        lambda: worker.set(f"{NAMESPACE}:anything", "1"),  # SET: not a command workers send
        lambda: worker.keys("*"),
        lambda: worker.execute_command("FLUSHALL"),
        lambda: worker.execute_command("CONFIG", "SET", "maxmemory", "1"),
        lambda: worker.execute_command("ACL", "SETUSER", "kvroute-worker", "+@all"),
    ]
    for command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    with pytest.raises(redis.exceptions.AuthenticationError):
        _client(acl_redis, None).ping()  # no anonymous access either
