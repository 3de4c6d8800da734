"""What sharing routing between gateway replicas costs per routed request: today's
stream entries against the format before 6 December 2026.

Two real ``ReplicaSync`` objects on one loop and a private Redis: a publisher and
its peer, which follows the stream and applies every entry (speculates the chain,
pins the session, counts the prefix's demand). Each round publishes ``--routes``
route entries (a small chat's: session key, ``--chain-blocks`` hashes, prefix),
``--per-flush`` of them per flush, and waits until the peer applied them all.
``today`` is the gateway's own publisher (one msgpack batch per flush, the
in-flight counts of the workers that changed); ``before`` writes the same
entries as the format before, one pipelined ``XADD`` each and the whole
in-flight view every flush, and the same follower reads them. With
``--busy-workers`` N the publisher has requests in flight on N workers (a
busy replica in front of a large fleet). Rounds alternate the two; printed is
the process CPU (publisher and follower together) per entry, the median over
rounds.

    python -m loadtest.bench_replica_stream
    python -m loadtest.bench_replica_stream --busy-workers 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from gateway.routing.index import BlockIndex
from gateway.routing.load import GatewayLoad
from gateway.routing.prefix_demand import PrefixDemand
from gateway.routing.replicas import FLUSH_S, MAXLEN, ReplicaSync
from gateway.routing.sessions import SessionMap
from loadtest.scale_redis import PrivateRedis


def _sync(url: str, key: str, loads: dict[str, GatewayLoad] | None = None) -> ReplicaSync:
    return ReplicaSync(
        lambda: aioredis.Redis.from_url(url),
        key,
        BlockIndex(),
        SessionMap(60.0),
        {} if loads is None else loads,
        speculative_ttl_s=2.0,
        known_worker=lambda w: True,
        prefix_demand=PrefixDemand(),
    )


WAIT_S = 60.0


async def _until_following(client: Any, key: str, peer: ReplicaSync) -> None:
    """Returns once ``peer`` reads the stream: it follows from its first read on, and an
    entry written before that (a slow start on a busy host) it never sees."""
    deadline = time.monotonic() + WAIT_S
    while peer.applied == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the peer did not follow the stream within {WAIT_S} s")
        await client.xadd(key, {"g": "probe", "l": "{}"})
        await asyncio.sleep(0.05)


async def _round(
    url: str, key: str, mode: str, routes: int, per_flush: int, blocks: int, busy: int
) -> float:
    """CPU seconds per entry for one round of ``mode``."""
    workers = [f"w{i}" for i in range(max(8, busy))]
    loads = {w: GatewayLoad(inflight=3, pending=1) for w in workers[:busy]}
    publisher, peer = _sync(url, key, loads), _sync(url, key)
    tasks = peer.start()
    if mode == "today":
        tasks += publisher.start()
    client = aioredis.Redis.from_url(url)
    await _until_following(client, key, peer)
    started = time.process_time()
    for i in range(routes):
        chain = [(i << 20) + k for k in range(blocks)]
        wid = workers[(i * 7919) % len(workers)]
        loads.setdefault(wid, GatewayLoad()).inflight += 1  # as the dispatcher counts it
        if mode == "today":
            publisher.routed(wid, chain, f"session-{i}", 62.0, i)
        elif i % per_flush == per_flush - 1 or i == routes - 1:
            pipe = client.pipeline(transaction=False)
            for j in range(i - i % per_flush, i + 1):
                entry = {
                    "g": publisher.gateway_id,
                    "w": workers[(j * 7919) % len(workers)],
                    "t": "62",
                    "c": np.asarray([(j << 20) + k for k in range(blocks)], "<u8").tobytes(),
                    "s": f"session-{j}",
                    "p": str(j),
                }
                pipe.xadd(key, entry, maxlen=MAXLEN, approximate=True)
            # Before: every flush carried the publisher's whole in-flight view.
            view = {w: [x.inflight, x.pending, x.pending_prefill_tokens] for w, x in loads.items()}
            whole = {"g": publisher.gateway_id, "l": json.dumps(view, separators=(",", ":"))}
            pipe.xadd(key, whole, maxlen=MAXLEN, approximate=True)
            await pipe.execute()
        if i % per_flush == per_flush - 1:
            await asyncio.sleep(FLUSH_S)
    last = f"session-{routes - 1}"  # entries apply in order: the last one, then all
    deadline = time.monotonic() + WAIT_S
    while peer.sessions.get(last, time.monotonic()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the peer did not apply {routes} routes within {WAIT_S} s")
        await asyncio.sleep(0.001)
    cpu = time.process_time() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.delete(key)
    await client.aclose()
    return cpu / routes


def run(rounds: int, routes: int, per_flush: int, blocks: int, busy: int = 0) -> dict[str, Any]:
    redis = PrivateRedis()
    try:
        cpu: dict[str, list[float]] = {"today": [], "before": []}
        for r in range(rounds):
            for mode in ("today", "before") if r % 2 == 0 else ("before", "today"):
                key = f"bench{r}{mode}:routes"
                cpu[mode].append(
                    asyncio.run(_round(redis.url, key, mode, routes, per_flush, blocks, busy))
                )
    finally:
        redis.close()
    today, before = (statistics.median(cpu[m]) * 1e6 for m in ("today", "before"))
    return {
        "benchmark": "replica stream: publish and apply one route entry, today vs before",
        "cpu_us_per_entry_today": round(today, 1),
        "cpu_us_per_entry_before": round(before, 1),
        "today_vs_before": round(today / before, 3),
        "rounds_us": {m: [round(v * 1e6, 1) for v in cpu[m]] for m in cpu},
        "routes": routes,
        "per_flush": per_flush,
        "chain_blocks": blocks,
        "busy_workers": busy,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_replica_stream", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--routes", type=int, default=4000)
    parser.add_argument("--per-flush", type=int, default=4, help="route entries per flush")
    parser.add_argument("--chain-blocks", type=int, default=16)
    parser.add_argument(
        "--busy-workers", type=int, default=0, help="workers the publisher has requests on"
    )
    a = parser.parse_args(argv)
    print(json.dumps(run(a.rounds, a.routes, a.per_flush, a.chain_blocks, a.busy_workers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
