"""Fault injection on a real fleet: client disconnects, a gateway restart, a Redis
outage and a worker killed under load.

One fleet (three ``kvroute worker`` processes on the tiny Llama, one gateway)
serves the whole module, on a Redis this module starts itself so it can kill
and restart it on the same port. The tests run in file order and the last one
kills a worker, so it stays last.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from contract.redis_layout import RedisLayout, decode_block_set
from loadtest.fleet import Fleet
from tests.reliability.fleetkit import (
    HEARTBEAT_TTL,
    all_blocks_free,
    call,
    dashboard,
    fault_fleet_config,
    first_tokens_relayed,
    model_name,
    stream,
    wait_for,
    worker_blocks,
    worker_finishes,
    worker_load,
)
from tests.support import RedisProcess

pytestmark = pytest.mark.slow

NAMESPACE = "kvfaults"
SYSTEM = "You are a careful assistant for the reliability suite. " * 6


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    proc = RedisProcess().start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="module")
def fleet(
    tiny_llama: Path, redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    config = fault_fleet_config(
        tiny_llama, redis_server.url, NAMESPACE, 3, str(tmp_path_factory.mktemp("faults-logs"))
    )
    with Fleet(config) as f:
        yield f


def _chat(model: str, user: str, max_tokens: int = 8, **extra: object) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        **extra,
    }


def _worker(fleet: Fleet, worker_id: str):  # -> WorkerProcess
    return next(w for w in fleet.workers if w.worker_id == worker_id)


async def test_client_disconnect_mid_stream_frees_blocks(fleet: Fleet) -> None:
    """A client that goes away aborts the worker's sequence; its blocks return to the free list."""
    model = model_name(fleet)
    body = {"model": model, "prompt": "disconnect me " * 20, "max_tokens": 3000}
    body |= {"ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(fleet.gateway_url + "/v1/completions", json=body)
        assert resp.status == 200
        worker = _worker(fleet, resp.headers["x-kvroute-worker"])
        aborts_before = worker_finishes(worker.http_url).get("abort", 0)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 5:
                break
        busy = worker_blocks(worker.http_url)
        assert busy["used"] > busy["pinned"], busy  # the sequence holds blocks right now
        resp.close()  # the client goes away mid-stream
    wait_for(lambda: all_blocks_free(fleet), 10, "every worker's used blocks back to pinned")
    wait_for(
        lambda: worker_finishes(worker.http_url).get("abort", 0) == aborts_before + 1,
        5,
        "the worker counted the aborted sequence",
    )
    assert worker_load(worker.http_url)["running"] == 0


def test_gateway_restart_rebuilds_index_from_redis(fleet: Fleet) -> None:
    """A new gateway process knows nothing but Redis, and still routes the next turn to the
    worker that holds the conversation."""
    model = model_name(fleet)
    turns: list[tuple[list[dict[str, str]], str]] = []
    for i in range(3):
        first = _chat(model, f"conversation {i}: tell me about topic {i * 7919}", 16)
        reply = call(fleet.gateway_url + "/v1/chat/completions", first)
        assert reply.status == 200, reply.body
        history = [
            *first["messages"],  # type: ignore[list-item]
            {"role": "assistant", "content": reply.body["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"and the follow-up to conversation {i}"},
        ]
        turns.append((history, reply.headers["x-kvroute-worker"]))

    assert fleet.gateway is not None
    fleet.gateway.send_signal(signal.SIGTERM)
    fleet.gateway.wait(timeout=15)
    fleet.start_gateway()
    fleet.wait_ready()
    holders = {holder for _, holder in turns}
    wait_for(
        lambda: all(dashboard(fleet.gateway_url)[h]["index_blocks"] > 0 for h in holders),
        5,
        "the new gateway loaded the holders' blocks from Redis",
    )

    for history, holder in turns:
        reply = call(
            fleet.gateway_url + "/v1/chat/completions",
            {"model": model, "messages": history, "max_tokens": 4},
        )
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-worker"] == holder
        assert reply.headers["x-kvroute-reason"] == "cache"
        assert reply.body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _mirror_whole(fleet: Fleet, r: redis.Redis) -> bool:
    """Registry, block sets and the gateway's mirror all agree with every worker's pool."""
    layout = RedisLayout(NAMESPACE)
    rows = dashboard(fleet.gateway_url)
    for w in fleet.workers:
        if not r.exists(layout.worker(w.worker_id)):
            return False
        pool = worker_blocks(w.http_url)["cached"]  # hashed blocks the pool can serve
        in_redis = len(decode_block_set(r.hvals(layout.blocks(w.worker_id))))
        row = rows.get(w.worker_id)
        if row is None or not row["healthy"] or not pool == in_redis == row["index_blocks"]:
            return False
    return True


async def test_redis_outage_under_load(fleet: Fleet, redis_server: RedisProcess) -> None:
    """Redis dies and comes back mid-load: zero failed requests, and the registry, block sets
    and gateway mirror are whole again within 5 s of Redis returning."""
    model = model_name(fleet)
    r = redis.Redis.from_url(redis_server.url)
    wait_for(lambda: _mirror_whole(fleet, r), 5, "a consistent mirror before the outage")
    statuses: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def client(n: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while not stop.is_set():
            body = _chat(model, f"client {n} question {i}", 6)
            if i % 2:
                res = await stream(session, fleet.gateway_url + "/v1/chat/completions", body)
                statuses.append((res.status if res.ok else -res.status, str(res.error or "")))
            else:
                async with session.post(
                    fleet.gateway_url + "/v1/chat/completions", json=body
                ) as rr:
                    statuses.append((rr.status, "" if rr.status == 200 else await rr.text()))
            i += 1

    async def watch_health() -> None:
        # The gateway must never drop a live worker just because Redis came back empty.
        while not stop.is_set():
            body = (await asyncio.to_thread(call, fleet.gateway_url + "/readyz")).body
            healthy.append(body["healthy_workers"])
            await asyncio.sleep(0.02)

    healthy: list[int] = []
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(client(n, session)) for n in range(6)]
        tasks.append(asyncio.create_task(watch_health()))
        await asyncio.sleep(1.5)
        before = len(statuses)
        redis_server.stop(kill=True)
        await asyncio.sleep(3.0)  # longer than the heartbeat TTL
        during = len(statuses) - before
        redis_server.start()
        back_at = time.monotonic()
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    failures = [s for s in statuses if s[0] != 200]
    assert not failures, (len(failures), len(statuses), failures[:2])
    assert min(healthy) == 3, f"the gateway dropped live workers: healthy went to {min(healthy)}"
    assert during > 0, "no request completed while Redis was down"
    assert len(statuses) > before + during
    left = max(0.5, 5.0 - (time.monotonic() - back_at))
    wait_for(lambda: _mirror_whole(fleet, r), left, "registry, block sets and mirror whole")
    assert call(fleet.gateway_url + "/readyz").body["healthy_workers"] == 3


async def test_worker_killed_under_load(fleet: Fleet, redis_server: RedisProcess) -> None:
    """SIGKILL a worker while 20 streams run: queued requests are retried elsewhere and succeed,
    running streams end with an error event (no hang), and the worker leaves routing and the
    index within two heartbeat TTLs. Must stay the last test: the fleet loses a worker."""
    model = model_name(fleet)
    url = fleet.gateway_url + "/v1/completions"
    bodies = [
        {"model": model, "prompt": f"stream {i} " + "load " * 12, "max_tokens": 400}
        | {"ignore_eos": True}
        for i in range(20)
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
        tasks = [asyncio.create_task(stream(session, url, b)) for b in bodies]

        def busy_worker() -> tuple[int, dict[str, int]] | None:
            # Running requests still in their first prefill have no token out yet: a kill
            # then retries them elsewhere, cleanly. Wait for one whose first token the
            # gateway has relayed (none of the 400-token streams has ended this early).
            relayed = first_tokens_relayed(fleet.gateway_url)
            for i, w in enumerate(fleet.workers):
                load = worker_load(w.http_url)
                # More first tokens relayed than requests finished: one is mid-stream.
                streaming = relayed.get(w.worker_id, 0) > sum(worker_finishes(w.http_url).values())
                if load["running"] >= 1 and load["waiting"] >= 2 and streaming:
                    return i, load
            return None

        victim_index, load_at_kill = await asyncio.to_thread(
            wait_for, busy_worker, 30, "a worker with running and queued requests", 0.01
        )
        victim = fleet.workers[victim_index].worker_id
        fleet.kill_worker(victim_index)
        killed_at = time.monotonic()
        gone = await asyncio.to_thread(
            wait_for,
            lambda: victim not in dashboard(fleet.gateway_url) and time.monotonic(),
            2 * HEARTBEAT_TTL + 1,
            "the dead worker dropped from the gateway's mirror",
            0.02,
        )
        results = await asyncio.wait_for(asyncio.gather(*tasks), 80)  # never a hang

    assert gone - killed_at <= 2 * HEARTBEAT_TTL, gone - killed_at
    assert call(fleet.gateway_url + "/readyz").body["healthy_workers"] == 2
    r = redis.Redis.from_url(redis_server.url)
    assert not r.exists(RedisLayout(NAMESPACE).worker(victim))

    broken = [res for res in results if not res.ok]
    assert all(res.status == 200 for res in results), [res.error for res in broken]
    for res in broken:  # only streams already running on the victim may fail, cleanly
        assert res.worker == victim
        assert res.done and res.error is not None and res.error["error"]["type"]
    assert 1 <= len(broken) <= load_at_kill["running"] + load_at_kill["waiting"]
    retried = [res for res in results if res.ok and res.worker != victim]
    assert len(retried) >= 20 - len(broken) and len(broken) < 20
    assert all(res.finish == "length" for res in results if res.ok)

    for i in range(12):
        reply = call(url, {"model": model, "prompt": f"after the kill {i}", "max_tokens": 4})
        assert reply.status == 200, reply.body
        assert reply.headers["x-kvroute-worker"] != victim
    wait_for(lambda: all_blocks_free(fleet), 10, "survivors' blocks free again")
