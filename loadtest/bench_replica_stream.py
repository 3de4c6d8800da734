"""What sharing routing between gateway replicas costs per routed request: the batched
stream entries of today against one stream entry per entry (before 6 December 2026).

Two real ``ReplicaSync`` objects on one loop and a private Redis: a publisher and
its peer, which follows the stream and applies every entry (speculates the chain,
pins the session, counts the prefix's demand). Each round publishes ``--routes``
route entries (a small chat's: session key, ``--chain-blocks`` hashes, prefix),
``--per-flush`` of them per flush, and waits until the peer applied them all.
``batched`` is the gateway's own publisher (one msgpack batch per flush);
``single`` writes the same entries as the format before, one pipelined ``XADD``
each, and the same follower reads them. Rounds alternate the two; printed is the
process CPU (publisher and follower together) per entry, the median over rounds.

    python -m loadtest.bench_replica_stream
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
from gateway.routing.prefix_demand import PrefixDemand
from gateway.routing.replicas import FLUSH_S, MAXLEN, ReplicaSync
from gateway.routing.sessions import SessionMap
from loadtest.scale_redis import PrivateRedis


def _sync(url: str, key: str) -> ReplicaSync:
    return ReplicaSync(
        lambda: aioredis.Redis.from_url(url),
        key,
        BlockIndex(),
        SessionMap(60.0),
        {},
        speculative_ttl_s=2.0,
        known_worker=lambda w: True,
        prefix_demand=PrefixDemand(),
    )


async def _round(url: str, key: str, mode: str, routes: int, per_flush: int, blocks: int) -> float:
    """CPU seconds per entry for one round of ``mode``."""
    publisher, peer = _sync(url, key), _sync(url, key)
    tasks = peer.start()
    if mode == "batched":
        tasks += publisher.start()
    client = aioredis.Redis.from_url(url)
    await asyncio.sleep(0.2)  # both listening, the start-up loads entries applied
    started = time.process_time()
    for i in range(routes):
        chain = [(i << 20) + k for k in range(blocks)]
        if mode == "batched":
            publisher.routed(f"w{i % 8}", chain, f"session-{i}", 62.0, i)
        elif i % per_flush == per_flush - 1 or i == routes - 1:
            pipe = client.pipeline(transaction=False)
            for j in range(i - i % per_flush, i + 1):
                entry = {
                    "g": publisher.gateway_id,
                    "w": f"w{j % 8}",
                    "t": "62",
                    "c": np.asarray([(j << 20) + k for k in range(blocks)], "<u8").tobytes(),
                    "s": f"session-{j}",
                    "p": str(j),
                }
                pipe.xadd(key, entry, maxlen=MAXLEN, approximate=True)
            # The publisher's changed in-flight counts go with every flush in both modes.
            pipe.xadd(key, {"g": publisher.gateway_id, "l": "{}"}, maxlen=MAXLEN, approximate=True)
            await pipe.execute()
        if i % per_flush == per_flush - 1:
            await asyncio.sleep(FLUSH_S)
    last = f"session-{routes - 1}"  # entries apply in order: the last one, then all
    while peer.sessions.get(last, time.monotonic()) is None:
        await asyncio.sleep(0.001)
    cpu = time.process_time() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.delete(key)
    await client.aclose()
    return cpu / routes


def run(rounds: int, routes: int, per_flush: int, blocks: int) -> dict[str, Any]:
    redis = PrivateRedis()
    try:
        cpu: dict[str, list[float]] = {"batched": [], "single": []}
        for r in range(rounds):
            for mode in ("batched", "single") if r % 2 == 0 else ("single", "batched"):
                key = f"bench{r}{mode}:routes"
                cpu[mode].append(
                    asyncio.run(_round(redis.url, key, mode, routes, per_flush, blocks))
                )
    finally:
        redis.close()
    batched, single = (statistics.median(cpu[m]) * 1e6 for m in ("batched", "single"))
    return {
        "benchmark": "replica stream: publish and apply one route entry, batched vs one each",
        "cpu_us_per_entry_batched": round(batched, 1),
        "cpu_us_per_entry_single": round(single, 1),
        "batched_vs_single": round(batched / single, 3),
        "rounds_us": {m: [round(v * 1e6, 1) for v in cpu[m]] for m in cpu},
        "routes": routes,
        "per_flush": per_flush,
        "chain_blocks": blocks,
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
    a = parser.parse_args(argv)
    print(json.dumps(run(a.rounds, a.routes, a.per_flush, a.chain_blocks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
