"""What a gateway's first requests cost against its later ones.

Starts instant fake workers (``loadtest.instant_workers``) and a kvroute
gateway in front of them, waits for ``/readyz`` and a quiet second, then sends
``--requests`` different chats one at a time, each on a new connection, and
prints one JSON object: each request's client latency, the first one's, and
the median of the rest. A first request that costs much more than the rest is
work the gateway left for its first client (connections, streams, caches)::

    python -m loadtest.probe_first_request [--workers 4] [--requests 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench_overhead import MODEL, Router, _router_cmd, start_fakes, wait_fakes
from loadtest.fleet import free_port
from loadtest.scale_redis import PrivateRedis


async def _probe(url: str, requests: int) -> list[float]:
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway never became ready")
            await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    out = []
    for i in range(requests):
        words = " ".join(f"w{i}x{j}" for j in range(150))
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": words}, {"role": "user", "content": "hi"}],
            "max_tokens": 4,
        }
        async with aiohttp.ClientSession() as http:  # a new connection, as a new client's
            t0 = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"request {i}: HTTP {resp.status}")
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(workers: int, requests: int) -> dict[str, Any]:
    redis = PrivateRedis()
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-first-"))
    fakes = start_fakes(workers, redis.url, "first", tmp / "ready.json")
    router = None
    try:
        urls = wait_fakes(fakes, tmp / "ready.json")
        port = free_port()
        cmd = _router_cmd("kvroute", port, redis.url, "first", urls)
        router = Router("kvroute", cmd, port, tmp / "gateway.log")
        latencies = asyncio.run(_probe(router.url, requests))
    finally:
        if router is not None:
            router.close()
        fakes.terminate()
        fakes.wait(10)
        redis.close()
    return {
        "latencies_ms": [round(x, 3) for x in latencies],
        "first_ms": latencies[0],
        "rest_p50_ms": statistics.median(latencies[1:]),
        "first_over_rest": latencies[0] / statistics.median(latencies[1:]),
        "workers": workers,
        "load_average": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12)
    args = ap.parse_args(argv)
    if args.requests < 2 or args.workers < 1:
        ap.error("--requests must be at least 2 and --workers at least 1")
    json.dump(run(args.workers, args.requests), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
