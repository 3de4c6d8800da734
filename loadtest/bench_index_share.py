"""What one index owner can serve to the front processes of a gateway (``--processes``).

A child process holds a fleet's block index (``loadtest.bench_scale.Fleet``:
realistic shared prefixes) and serves it on a unix socket with the gateway's
real ``IndexServer``; this process is a front with the real ``RemoteIndex``,
looking up 4k-token chains (``--chain-blocks`` 256, the worker's whole
conversation cached; 16 is a small chat's prompt) from ``--concurrency`` tasks for ``--seconds``. Printed: look-ups per
second, the owner's and the front's CPU per look-up, the look-up's wall time
p50/p99, and ``lookups_per_owner_core_s`` (1 / owner CPU per look-up): divided
by a front's request rate, how many fronts one owner's core can answer.

    python -m loadtest.bench_index_share
    python -m loadtest.bench_index_share --workers 1000 --blocks 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

import psutil

from gateway.routing.index import BlockIndex
from gateway.routing.index_share import IndexServer, RemoteIndex
from loadtest.bench_scale import Fleet


def _owner(path: str, workers: int, blocks: int, ready: Any) -> None:
    fleet = Fleet(workers, blocks)
    index = BlockIndex()
    for w in range(workers):
        index.replace(f"w{w}", fleet.worker_hashes(w).tolist())

    async def serve() -> None:
        server = IndexServer(path, index)
        await server.start(lambda: asyncio.sleep(0, b""))
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(serve())


async def _front(path: str, chains: list[list[int]], concurrency: int, seconds: float) -> Any:
    remote = RemoteIndex(path)
    await remote.connect(lambda: asyncio.sleep(0, b""))
    wall: list[float] = []
    hits = 0
    stop = time.monotonic() + seconds

    async def one(k: int) -> None:
        nonlocal hits
        i = k
        while time.monotonic() < stop:
            chain = chains[i % len(chains)]
            i += concurrency
            t0 = time.perf_counter()
            found = await remote.longest_prefix(chain)
            wall.append(time.perf_counter() - t0)
            hits += bool(found)

    cpu0 = time.process_time()
    t0 = time.monotonic()
    await asyncio.gather(*(one(k) for k in range(concurrency)))
    return wall, hits, time.process_time() - cpu0, time.monotonic() - t0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(
    workers: int, blocks: int, concurrency: int, seconds: float, chain_blocks: int = 256
) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="kvr-share-")
    path = os.path.join(folder, "index.sock")
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    owner = ctx.Process(target=_owner, args=(path, workers, blocks, ready), daemon=True)
    owner.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the index owner did not start")
        fleet = Fleet(workers, blocks)  # same seed: the same chains the owner holds
        for w in range(min(workers, 64)):
            fleet.worker_hashes(w)
        chains = [chain[:chain_blocks] for _, chain in fleet.samples]
        ps = psutil.Process(owner.pid)
        own0 = sum(ps.cpu_times()[:2])
        wall, hits, front_cpu, elapsed = asyncio.run(_front(path, chains, concurrency, seconds))
        owner_cpu = sum(ps.cpu_times()[:2]) - own0
    finally:
        owner.kill()
        owner.join()
        shutil.rmtree(folder, ignore_errors=True)
    n = len(wall)
    owner_us = owner_cpu * 1e6 / n
    return {
        "benchmark": "block index shared by a gateway's processes (unix socket)",
        "workers": workers,
        "blocks_per_worker": blocks,
        "chain_blocks": len(chains[0]),
        "concurrency": concurrency,
        "lookups": n,
        "hit_fraction": round(hits / n, 4),
        "lookups_per_s": round(n / elapsed),
        "owner_cpu_us_per_lookup": round(owner_us, 1),
        "front_cpu_us_per_lookup": round(front_cpu * 1e6 / n, 1),
        "lookup_wall_p50_ms": round(_pct(wall, 0.5) * 1e3, 3),
        "lookup_wall_p99_ms": round(_pct(wall, 0.99) * 1e3, 3),
        "lookups_per_owner_core_s": round(1e6 / owner_us),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "command": "python -m loadtest.bench_index_share "
        f"--workers {workers} --blocks {blocks} --concurrency {concurrency} --seconds {seconds:g} "
        f"--chain-blocks {chain_blocks}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_index_share", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--chain-blocks", type=int, default=256, help="blocks looked up (256: a 4k-token prompt)"
    )
    a = parser.parse_args(argv)
    print(json.dumps(run(a.workers, a.blocks, a.concurrency, a.seconds, a.chain_blocks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
