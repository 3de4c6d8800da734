"""``bench_scale``'s Redis half: the real ``Publisher`` and ``IndexMirror`` on a private redis-server.

One worker publishes a large block set with the real ``Publisher``; the real
``IndexMirror`` loads it (``load_worker_ms``) while a probe task measures the
longest event-loop stall; Redis bytes per block (``MEMORY USAGE`` of the set)
and per stream entry; CPU of one registry poll with many registered workers.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from contract.redis_layout import RedisLayout, WorkerRecord
from gateway.routing.index import BlockIndex
from gateway.routing.mirror import IndexMirror
from gateway.routing.mirror_state import WorkerEntry
from loadtest.fleet import free_port


class PrivateRedis:
    """A private redis-server for the benchmark."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server")
        self.dir = tempfile.mkdtemp(prefix="kvroute-bench-scale-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class FakeEngine:
    def __init__(self, hashes: set[int]) -> None:
        self.hashes = hashes

    def stats(self) -> Any:
        class S:
            num_blocks = max(1, len(self.hashes))
            running = waiting = queued_prefill_tokens = free_blocks = 0
            prefill_tokens_per_s = decode_tokens_per_s = 0.0

        return S()

    def resident_block_hashes(self) -> set[int]:
        return set(self.hashes)


async def _loop_probe(stalls: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """(CPU ms, wall ms) between wake-ups: the CPU is what other tasks held the loop for."""
    last, last_cpu = time.perf_counter(), time.thread_time()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now, cpu = time.perf_counter(), time.thread_time()
        stalls.append(((cpu - last_cpu) * 1e3, (now - last) * 1e3))
        last, last_cpu = now, cpu


async def bench_redis(
    blocks: int,
    registry_workers: int,
    *,
    random_hashes: Callable[[int], np.ndarray],
    block_size: int,
) -> dict[str, Any]:
    """Publisher -> Redis -> mirror for one big worker; registry poll at fleet size.

    ``random_hashes(n)`` draws the block hashes (``bench_scale``'s seeded generator).
    """
    from worker.publish.event_queue import EventQueue
    from worker.publish.publisher import Publisher, PublisherConfig

    server = PrivateRedis()
    try:
        layout = RedisLayout("bench")
        hashes = set(random_hashes(blocks).tolist())
        engine = FakeEngine(hashes)
        record = WorkerRecord(worker_id="big", address="127.0.0.1:1", block_size=block_size)
        pub = Publisher(
            engine, EventQueue(), PublisherConfig(server.url, "big", namespace="bench"), record
        )
        await pub.start()
        client = aioredis.Redis.from_url(server.url)
        deadline = time.monotonic() + 60
        while pub.syncs == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("publisher never synced")
            await asyncio.sleep(0.05)
        sync = redis.Redis.from_url(server.url)
        blocks_bytes = int(sync.memory_usage(layout.blocks("big"), samples=0) or 0)
        # Stream entries: a step's worth of events, as the engine sends them.
        before = int(sync.memory_usage(layout.events("big"), samples=0) or 0)
        extra = random_hashes(2000).tolist()
        for i in range(0, 2000, 8):
            pub.queue.put([_stored(extra[i : i + 8])])
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.5)
        n_entries = int(sync.xlen(layout.events("big")))
        after = int(sync.memory_usage(layout.events("big"), samples=0) or 0)
        stream_bytes = (after - before) / max(1, n_entries - 1)

        index = BlockIndex()
        mirror = IndexMirror(server.url, layout, index)
        await mirror.sync_registry(client)
        await mirror.load_pending(client)
        assert index.block_count("big") >= blocks, index.block_count("big")
        # A full reload of the 100k worker while the loop is probed.
        load_ms = []
        stall_max = stall_wall = 0.0
        for _ in range(3):
            stalls: list[tuple[float, float]] = []
            stop = asyncio.Event()
            probe = asyncio.create_task(_loop_probe(stalls, stop))
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            await mirror.load_worker(client, "big")
            load_ms.append((time.perf_counter() - t0) * 1e3)
            stop.set()
            await probe
            stall_max = max(stall_max, max(c for c, _ in stalls))
            stall_wall = max(stall_wall, max(w for _, w in stalls))
        await pub.stop()

        # Registry poll at fleet size: records as workers write them (all live).
        for i in range(registry_workers):
            rec = WorkerRecord(
                worker_id=f"r{i}",
                address=f"127.0.0.1:{20000 + i}",
                block_size=block_size,
                hash_spec={"version": "x"},
                epoch="e",
                running=i % 5,
                updated_at=time.time(),
            )
            sync.hset(layout.worker(rec.worker_id), mapping=rec.to_mapping())
            sync.sadd(layout.workers, rec.worker_id)
        mirror2 = IndexMirror(server.url, layout, BlockIndex())
        for wid in [f"r{i}" for i in range(registry_workers)]:
            rec = WorkerRecord(worker_id=wid, address="x", epoch="e")
            mirror2.workers[wid] = WorkerEntry(record=rec, spec=None, loaded=True)
        await mirror2.sync_registry(client)  # first pass
        await mirror2.load_pending(client)
        polls = []
        for _ in range(5):
            # The worst case: every worker heartbeated since the last poll.
            pipe = sync.pipeline(transaction=False)
            for i in range(registry_workers):
                pipe.hset(layout.worker(f"r{i}"), "updated_at", str(time.time()))
            pipe.execute()
            t0 = time.process_time()
            await mirror2.sync_registry(client)
            polls.append((time.process_time() - t0) * 1e3)
        await client.aclose()
        return {
            "blocks": blocks,
            "redis_bytes_per_block": round(blocks_bytes / blocks, 1),
            "redis_stream_bytes_per_entry": round(stream_bytes, 1),
            "stream_entry_blocks": 8,
            "load_worker_ms": round(statistics.median(load_ms), 1),
            "max_loop_stall_ms": round(stall_max, 1),
            "max_loop_stall_wall_ms": round(stall_wall, 1),
            "registry_workers": registry_workers,
            "registry_poll_cpu_ms": round(statistics.median(polls), 1),
        }
    finally:
        server.close()


def _stored(hashes: list[int]) -> Any:
    from contract.events import BlockStored

    return BlockStored(tuple(hashes))
