"""A worker that leaves, hangs or lies loses no request: rolling restart, SIGSTOP, rogue records.

Rolling restart: two real workers, each SIGTERMed in turn (and started again)
while 30 streaming conversations run through a real gateway. The worker
deregisters first, refuses new calls (the gateway retries them elsewhere before
their first token) and finishes the streams it has; the gateway keeps a
departed worker's channel open for those streams. Every stream must end with a
finish reason and ``[DONE]``, with no error and no non-200 answer.

SIGSTOP: one of two workers frozen for 20 s mid-load. Requests waiting for its
first token are retried elsewhere as soon as its heartbeat lapses; streams it
had started end with an in-band error after the inter-token timeout; none hangs
past the first-token timeout, and no request started after its heartbeat lapsed
(TTL 2 s, plus a registry poll) is routed to it until it runs again.

Rogue records: registry hashes written straight into Redis (a NaN prefill
rate, a 2-token context) are left out of routing: no 500, no fleet-wide limit.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from contract.redis_layout import RedisLayout, WorkerRecord
from loadtest.fleet import Fleet, FleetConfig
from tests.reliability.fleetkit import StreamResult, call, dashboard, model_name, stream
from tests.support import RedisProcess

pytestmark = pytest.mark.slow

CONVERSATIONS = 30
NAMESPACE = "kvleaves"
TIMEOUT_S = 3.0  # the gateway's inter-token timeout here
FIRST_TOKEN_S = 30.0  # the gateway's first-token timeout here
STOP_S = 20.0  # how long the SIGSTOP test freezes a worker
LAPSE_S = 3.0  # a frozen worker's key lapses (TTL 2 s) and a registry poll (0.5 s) sees it


@pytest.fixture(scope="module")
def fleet(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    proc = RedisProcess().start()
    config = FleetConfig(
        model=str(tiny_llama),
        workers=2,
        redis_url=proc.url,
        namespace=NAMESPACE,
        num_blocks=1024,
        max_num_seqs=8,
        heartbeat_interval=0.5,
        heartbeat_ttl=2.0,
        log_dir=str(tmp_path_factory.mktemp("leaves-logs")),
        gateway_args=(
            "--log-level",
            "warning",
            "--first-token-timeout",
            str(FIRST_TOKEN_S),
            "--inter-token-timeout",
            str(TIMEOUT_S),
        ),
    )
    try:
        with Fleet(config) as f:
            yield f
    finally:
        proc.close()


def _restart(fleet: Fleet, worker_id: str) -> None:
    """SIGTERM ``worker_id``, wait for its drain to end, start it again under the same id."""
    i = next(i for i, w in enumerate(fleet.workers) if w.worker_id == worker_id)
    old = fleet.workers.pop(i)
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(timeout=60) == 0
    fleet.start_worker(int(worker_id.rsplit("-", 1)[1]))
    fleet.wait_ready()


async def test_rolling_restart_under_streaming_conversations(fleet: Fleet) -> None:
    model = model_name(fleet)
    url = fleet.gateway_url + "/v1/chat/completions"
    results: list[StreamResult] = []
    stop = asyncio.Event()

    async def conversation(n: int, session: aiohttp.ClientSession) -> None:
        messages = [{"role": "user", "content": f"conversation {n}: tell me a story"}]
        while not stop.is_set():
            body = {"model": model, "messages": messages, "max_tokens": 24, "ignore_eos": True}
            res = await stream(session, url, body, headers={"X-Session-ID": f"conv-{n}"})
            results.append(res)
            messages = [
                *messages[-5:],
                {"role": "assistant", "content": res.text},
                {"role": "user", "content": f"and then? ({len(results)})"},
            ]

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(conversation(n, session)) for n in range(CONVERSATIONS)]
        # Both workers serve streams before the restarts begin (so each SIGTERM lands on
        # work in flight), however slowly a loaded machine warms them up.
        for _ in range(200):
            await asyncio.sleep(0.1)
            if {r.worker for r in results} >= {"worker-0", "worker-1"}:
                break
        served_before: dict[str, int] = {}
        for w in ["worker-0", "worker-1"]:
            served_before[w] = sum(r.worker == w for r in results)
            await asyncio.to_thread(_restart, fleet, w)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    bad = [r for r in results if not r.ok]
    assert not bad, (len(bad), len(results), [(r.status, r.error, r.done) for r in bad[:3]])
    assert len(results) >= 3 * CONVERSATIONS
    # Both workers served traffic before their restart, and both are back in the fleet.
    assert all(served_before.values()), served_before
    rows = dashboard(fleet.gateway_url)
    assert set(rows) == {"worker-0", "worker-1"} and all(r["healthy"] for r in rows.values())
    assert call(fleet.gateway_url + "/readyz").body["healthy_workers"] == 2


def _worker(fleet: Fleet, worker_id: str):  # -> loadtest.fleet.WorkerProcess
    return next(w for w in fleet.workers if w.worker_id == worker_id)


async def test_sigstopped_worker_loses_no_request(fleet: Fleet) -> None:
    """SIGSTOP one of two workers for 20 s under streaming load (issue 14's acceptance)."""
    model = model_name(fleet)
    url = fleet.gateway_url + "/v1/completions"
    victim = _worker(fleet, "worker-0")
    done: list[tuple[float, float, StreamResult]] = []  # (started, seconds, result)
    stop = asyncio.Event()

    async def client(n: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while not stop.is_set():
            body = {"model": model, "prompt": f"client {n} turn {i} " * 4, "max_tokens": 32}
            started = time.monotonic()
            res = await stream(session, url, body | {"ignore_eos": True})
            done.append((started, time.monotonic() - started, res))
            i += 1

    probes: list[tuple[int, str]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        tasks = [asyncio.create_task(client(n, session)) for n in range(10)]
        await asyncio.sleep(1.5)
        victim.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            await asyncio.sleep(LAPSE_S)  # past the 2 s TTL and a registry poll
            while time.monotonic() - stopped_at < STOP_S:  # new requests: never the frozen one
                body = {"model": model, "prompt": f"probe {len(probes)}", "max_tokens": 4}
                async with session.post(url, json=body) as resp:
                    probes.append((resp.status, resp.headers.get("x-kvroute-worker", "")))
                await asyncio.sleep(1.0)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    assert len(probes) >= 5 and all(p == (200, "worker-1") for p in probes), probes
    results = [r for _, _, r in done]
    # Every request completed or ended with an in-band error event and [DONE].
    assert all(r.status == 200 and r.done for r in results), [r.error for r in results]
    cut = [r for r in results if not r.ok]
    assert all(r.error and r.error["error"]["code"] == "timeout" for r in cut), cut[:2]
    assert all(r.worker == victim.worker_id for r in cut), [r.worker for r in cut]
    assert len(cut) <= 10  # at most the streams that were running on it
    # None hung: a retry after one timeout, an error after the other, far below
    # the first-token timeout.
    assert max(t for _, t, _ in done) < min(2 * TIMEOUT_S + 10, FIRST_TOKEN_S), max(
        t for _, t, _ in done
    )
    # Once its heartbeat lapsed, nothing started while it was stopped went to it.
    late = [
        (round(start - stopped_at, 1), r.worker)
        for start, _, r in done
        if stopped_at + LAPSE_S < start < resumed_at and r.worker == victim.worker_id
    ]
    assert not late, late
    during = [r for start, _, r in done if stopped_at + LAPSE_S < start < resumed_at]
    assert sum(r.ok for r in during) >= 20, "the healthy worker served too little meanwhile"
    fleet.wait_ready()  # the worker re-registers once it runs again


def test_rogue_registry_records_are_ignored(fleet: Fleet) -> None:
    model = model_name(fleet)
    layout = RedisLayout(NAMESPACE)
    r = redis.Redis.from_url(fleet.redis_url)
    models_before = call(fleet.gateway_url + "/v1/models").body["data"][0]
    rogues = {
        "rogue-nan": {"prefill_tokens_per_s": math.nan},
        "rogue-tiny": {"max_model_len": 2, "prefill_tokens_per_s": 1e9},
    }
    base = WorkerRecord(worker_id="", address="127.0.0.1:1", model=model, epoch="rogue")
    try:
        for wid, fields in rogues.items():
            rec = WorkerRecord(**{**base.__dict__, "worker_id": wid, **fields})
            r.hset(layout.worker(wid), mapping=rec.to_mapping())  # no TTL: it never expires
            r.sadd(layout.workers, wid)
        time.sleep(1.5)  # a few registry polls
        for i in range(8):
            body = {"model": model, "prompt": f"after the rogues {i} " * 3, "max_tokens": 4}
            reply = call(fleet.gateway_url + "/v1/completions", body)
            assert reply.status == 200, reply.body
            assert reply.headers["x-kvroute-worker"] in ("worker-0", "worker-1")
        assert call(fleet.gateway_url + "/v1/models").body["data"][0] == models_before
        metrics = call(fleet.gateway_url + "/metrics").body
        assert 'reason="prefill_tokens_per_s_not_finite"} 1.0' in metrics
    finally:
        for wid in rogues:
            r.delete(layout.worker(wid))
            r.srem(layout.workers, wid)
