"""Redis at maxmemory under load: no fleet-wide 503, requests still served.

A real ``redis-server`` with ``--maxmemory 2mb`` and ``noeviction`` (the
chart's policy), two real workers and a real gateway under streaming and plain
chat load. Mid-load the test fills Redis until it refuses writes and holds it
there for three heartbeat TTLs: the workers' block-set writes and record
``HSET``s are refused, their heartbeat's ``PEXPIRE`` is not, so no registry
key lapses and the gateway keeps both workers; routing degrades to sessions
and load (the index stops following the pools). Once Redis has room again the
workers re-sync and the mirror equals their pools.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from contract.redis_layout import RedisLayout, decode_block_set
from loadtest.fleet import Fleet
from tests.reliability.fleetkit import (
    HEARTBEAT_TTL,
    call,
    dashboard,
    fault_fleet_config,
    model_name,
    stream,
    wait_for,
    worker_blocks,
)
from tests.support import RedisProcess, fill_redis, make_room

pytestmark = pytest.mark.slow

NAMESPACE = "kvfull"
MAXMEMORY = "2mb"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    proc = RedisProcess(
        extra_args=("--maxmemory", MAXMEMORY, "--maxmemory-policy", "noeviction")
    ).start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="module")
def fleet(
    tiny_llama: Path, redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    config = fault_fleet_config(
        tiny_llama, redis_server.url, NAMESPACE, 2, str(tmp_path_factory.mktemp("full-logs"))
    )
    with Fleet(config) as f:
        yield f


def _mirror_whole(fleet: Fleet, r: redis.Redis) -> bool:
    """Every worker registered, its Redis set equal to its pool and to the gateway's index."""
    layout = RedisLayout(NAMESPACE)
    rows = dashboard(fleet.gateway_url)
    for w in fleet.workers:
        if not r.exists(layout.worker(w.worker_id)):
            return False
        pool = worker_blocks(w.http_url)["cached"]
        in_redis = len(decode_block_set(r.hvals(layout.blocks(w.worker_id))))
        row = rows.get(w.worker_id)
        if row is None or not row["healthy"] or not pool == in_redis == row["index_blocks"]:
            return False
    return True


def _log(fleet: Fleet, name: str) -> str:
    path = fleet.log_path(name)
    return path.read_text(errors="replace") if path is not None and path.exists() else ""


async def test_a_full_redis_under_load_takes_no_worker_down(
    fleet: Fleet, redis_server: RedisProcess
) -> None:
    model = model_name(fleet)
    url = fleet.gateway_url + "/v1/chat/completions"
    phase = "before"
    served: list[tuple[str, int, str]] = []  # (phase, status, worker)
    healthy: list[int] = []
    ttls: list[int] = []  # both registry keys' PTTL while Redis is full (-2: gone)
    stop = asyncio.Event()
    r = redis.Redis.from_url(redis_server.url)
    keys = [RedisLayout(NAMESPACE).worker(w.worker_id) for w in fleet.workers]

    async def client(n: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while not stop.is_set():
            messages = [{"role": "user", "content": f"client {n} asks question {i}"}]
            body = {"model": model, "messages": messages, "max_tokens": 8}
            headers = {"X-Session-ID": f"full-{n}"}
            if i % 2:
                res = await stream(session, url, body, headers=headers)
                served.append((phase, res.status if res.ok else -res.status, res.worker))
            else:
                async with session.post(url, json=body, headers=headers) as resp:
                    await resp.read()
                    served.append((phase, resp.status, resp.headers.get("x-kvroute-worker", "")))
            i += 1

    async def watch_health() -> None:
        while not stop.is_set():
            body = (await asyncio.to_thread(call, fleet.gateway_url + "/readyz")).body
            healthy.append(body["healthy_workers"])
            if phase == "full":
                ttls.extend([await asyncio.to_thread(r.pttl, key) for key in keys])
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        tasks = [asyncio.create_task(client(n, session)) for n in range(6)]
        tasks.append(asyncio.create_task(watch_health()))
        await asyncio.sleep(1.5)
        filler = await asyncio.to_thread(fill_redis, redis_server.url)
        phase = "full"
        await asyncio.sleep(3 * HEARTBEAT_TTL)  # every TTL would have run out by now
        refused = [w.worker_id for w in fleet.workers if "maxmemory" in _log(fleet, w.worker_id)]
        await asyncio.to_thread(make_room, redis_server.url, filler, MAXMEMORY)
        phase = "after"
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    failures = [s for s in served if s[1] != 200]
    assert not failures, (len(failures), len(served), failures[:3])
    assert healthy and min(healthy) == 2, f"the gateway dropped workers: {min(healthy)}"
    during = [s for s in served if s[0] == "full"]
    assert len(during) >= 6, "too few requests served while Redis was full"
    assert {w for _, _, w in during} == {"worker-0", "worker-1"}  # load still spreads
    assert refused, "Redis never refused a worker's write: the test did not fill it"
    # The keys themselves stayed (the heartbeat's PEXPIRE), not only the gateway's hold.
    assert ttls and min(ttls) > 0, sorted(ttls)[:5]
    metrics = call(fleet.gateway_url + "/metrics").body
    assert "kvroute_gateway_registry_fleet_vanished_total 0.0" in metrics
    wait_for(lambda: _mirror_whole(fleet, r), 10, "registry, block sets and mirror whole again")
