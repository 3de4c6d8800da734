"""The mirror at scale, against real Redis: it equals Redis after any history, and on a Cluster.

- A seeded random history of stores, removes, clears, lost batches (gaps),
  restarts (new epochs) and deaths over a few workers, written the way the
  publisher writes it; afterwards the index equals every live worker's Redis
  set and holds nothing of the dead.
- The real ``Publisher`` and ``IndexMirror`` against a 3-node Redis Cluster
  started here from ``redis-server``: per-worker hash tags put each worker's
  keys in one slot, so its MULTI/EXEC and the mirror's loads and tail work.
- A reload of one worker is staged: lookups see its old blocks until the new
  set is complete, and the loop is never blocked by it.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored
from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, WorkerRecord, decode_block_set
from gateway.routing.index import BlockIndex
from gateway.routing.mirror import IndexMirror
from tests.gateway.fakes import FakeRegistration
from tests.gateway.helpers import eventually, namespace, running
from tests.support import free_port, wait_for_port
from worker.publish.event_queue import EventQueue
from worker.publish.publisher import Publisher, PublisherConfig

SPEC = HashSpec(block_size=4, model="m")


async def _redis_sets(client: Any, layout: RedisLayout, wids: list[str]) -> dict[str, set[int]]:
    return {w: set(decode_block_set(await client.hvals(layout.blocks(w)))) for w in wids}


def _index_matches(index: BlockIndex, want: dict[str, set[int]]) -> bool:
    if index.workers() != sorted(want):
        return False
    for w, held in want.items():
        if index.block_count(w) != len(held) or not all(index.holds(w, h) for h in held):
            return False
    return True


async def test_index_equals_redis_after_any_history(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    layout = RedisLayout(namespace())
    mirror = IndexMirror(redis_url, layout, BlockIndex(), poll_s=0.05, reconnect_grace_s=0)
    rnd = random.Random(7)
    pool = [rnd.getrandbits(64) for _ in range(300)]
    regs = {w: FakeRegistration(client, layout, w, "127.0.0.1:1", SPEC) for w in "abcd"}
    for reg in regs.values():
        await reg.register()
    async with running(mirror):
        for step in range(150):
            w = rnd.choice(sorted(regs))
            reg = regs[w]
            op = rnd.random()
            hashes = tuple(rnd.sample(pool, rnd.randint(1, 25)))
            if op < 0.45:
                await reg.store(hashes)
            elif op < 0.7:
                await reg.remove(hashes)
            elif op < 0.78:
                await reg.publish([AllBlocksCleared(), BlockStored(hashes)])
            elif op < 0.86:
                # A batch lost between set and stream: the next one leaves a seq gap.
                await reg.publish([BlockStored(hashes)], touch_stream=False)
                await reg.publish([BlockRemoved(hashes[:2])], seq=reg.seq + 1)
            elif op < 0.92:
                # A restart: new epoch, fresh set and stream.
                await client.delete(layout.blocks(w), layout.events(w))
                reg.seq = 0
                reg.blockset.reset((), 0)
                await reg.register(epoch=f"epoch-{step}")
                await reg.publish([AllBlocksCleared(), BlockStored(hashes)])
            elif op < 0.96 and len(regs) > 1:
                await reg.expire()  # it died
                await client.delete(layout.blocks(w), layout.events(w))
                del regs[w]
            else:
                await reg.register()  # a heartbeat
            if step % 10 == 0:
                await asyncio.sleep(0.01)  # let the tail interleave with the writes
        want = await _redis_sets(client, layout, sorted(regs))
        await eventually(lambda: _index_matches(mirror.index, want), timeout=10, what="equal")
        assert sorted(mirror.workers) == sorted(regs)
        assert mirror.reloads > 0  # the gaps and epochs really reloaded
    await client.aclose()


async def test_a_reload_is_staged_and_swapped_in_whole(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    layout = RedisLayout(namespace())
    index = BlockIndex()
    mirror = IndexMirror(redis_url, layout, index, poll_s=0.05)
    reg = FakeRegistration(client, layout, "w1", "127.0.0.1:1", SPEC)
    await reg.register()
    big = list(range(1, 20_001))
    await reg.store(big)
    await mirror.sync_registry(client)
    await mirror.load_pending(client)
    assert index.block_count("w1") == 20_000
    # While a reload runs, every lookup sees the whole old set, never a part.
    seen: list[int] = []
    stalls: list[float] = []

    async def watch() -> None:
        last = time.perf_counter()
        while True:
            seen.append(index.longest_prefix(big[:50]).get("w1", 0))
            await asyncio.sleep(0)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    watcher = asyncio.create_task(watch())
    await mirror.load_worker(client, "w1")
    watcher.cancel()
    assert len(seen) > 3 and set(seen) == {50}
    assert index.block_count("w1") == 20_000 and index.stats().entries == 20_000
    assert max(stalls) < 0.5  # yields between slices (generous: a shared CI machine)
    await client.aclose()


# -- Redis Cluster -------------------------------------------------------------------


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a valid, free port too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@pytest.fixture
def redis_cluster() -> Iterator[list[int]]:
    """Three empty redis-server nodes joined into one Cluster (no replicas)."""
    binary = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    assert binary and cli, "redis-server and redis-cli are needed (apt-get install redis-server)"
    root = Path(tempfile.mkdtemp(prefix="kvroute-cluster-"))
    ports = [_cluster_port() for _ in range(3)]
    procs = []
    try:
        for port in ports:
            d = root / str(port)
            d.mkdir()
            procs.append(
                subprocess.Popen(
                    [
                        *(binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
                        *("--appendonly", "no", "--dir", str(d), "--cluster-enabled", "yes"),
                        *("--cluster-config-file", str(d / "nodes.conf")),
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
        for port in ports:
            wait_for_port(port, timeout=10)
        subprocess.run(
            [
                *(cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports]),
                *("--cluster-replicas", "0", "--cluster-yes"),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while redis.Redis(port=ports[0]).cluster("info").get("cluster_state") != "ok":
            assert time.monotonic() < deadline, "cluster never became ok"
            time.sleep(0.1)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


class _Pool:
    """Just enough engine for the publisher: a set of resident hashes and stats."""

    def __init__(self, hashes: set[int]) -> None:
        self.hashes = hashes

    def stats(self) -> Any:
        class Stats:
            num_blocks = 4096
            running = waiting = queued_prefill_tokens = free_blocks = 0
            prefill_tokens_per_s = decode_tokens_per_s = 0.0

        return Stats()

    def resident_block_hashes(self) -> set[int]:
        return set(self.hashes)


async def test_publisher_and_mirror_on_a_three_node_cluster(redis_cluster: list[int]) -> None:
    url = f"redis://127.0.0.1:{redis_cluster[0]}/0"
    layout = RedisLayout(namespace())
    rnd = random.Random(3)
    wids = [f"w{i}" for i in range(6)]  # spread over the three nodes' slots
    pools = {w: {rnd.getrandbits(64) for _ in range(300)} for w in wids}
    pubs = []
    for w in wids:
        queue = EventQueue()
        record = WorkerRecord(worker_id=w, address="127.0.0.1:1", hash_spec=SPEC.describe())
        config = PublisherConfig(url, w, layout.namespace, cluster=True)
        pubs.append((Publisher(_Pool(pools[w]), queue, config, record), queue))
    cluster = aioredis.RedisCluster.from_url(url)
    slots = {cluster.keyslot(layout.blocks(w)) for w in wids}
    assert len(slots) == len(wids)
    for w in wids:  # one hash tag: a worker's keys share its slot
        assert cluster.keyslot(layout.worker(w)) == cluster.keyslot(layout.events(w))
    for pub, _ in pubs:
        await pub.start()
    mirror = IndexMirror(url, layout, BlockIndex(), poll_s=0.05, cluster=True)
    try:
        async with running(mirror):
            await eventually(
                lambda: _index_matches(mirror.index, pools), timeout=15, what="cluster snapshot"
            )
            # Deltas through the stream tail.
            for (_, queue), w in zip(pubs, wids, strict=True):
                new = [rnd.getrandbits(64) for _ in range(5)]
                gone = sorted(pools[w])[:10]
                queue.put([BlockStored(tuple(new)), BlockRemoved(tuple(gone))])
                pools[w] = (pools[w] | set(new)) - set(gone)
            await eventually(
                lambda: _index_matches(mirror.index, pools), timeout=15, what="cluster tail"
            )
            assert await _redis_sets(cluster, layout, wids) == pools
            # A clean stop deletes its keys (directory outside the slot's transaction).
            await pubs[0][0].stop()
            del pools[wids[0]]
            await eventually(lambda: wids[0] not in mirror.workers, timeout=15, what="drop")
            assert _index_matches(mirror.index, pools)
    finally:
        for pub, _ in pubs[1:]:
            await pub.stop()
        await cluster.aclose()


async def test_a_dropped_connection_reloads_nothing_that_did_not_change(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    layout = RedisLayout(namespace())
    mirror = IndexMirror(redis_url, layout, BlockIndex(), poll_s=0.05)
    regs = [FakeRegistration(client, layout, w, "127.0.0.1:1", SPEC) for w in ("a", "b")]
    for n, reg in enumerate(regs):
        await reg.register()
        await reg.store([10 * n + 1, 10 * n + 2])
    async with running(mirror):
        await eventually(lambda: mirror.index.stats().entries == 4, what="loaded")
        reconnects = mirror.reconnects
        # Every client connection of this Redis is cut (a failover, a proxy restart).
        await client.client_kill_filter(_type="normal", skipme=True)
        await eventually(lambda: mirror.reconnects > reconnects, what="reconnect")
        await regs[0].store([3])  # the tail resumes where it was
        await eventually(lambda: mirror.index.holds("a", 3), what="tail after reconnect")
        assert [mirror.workers[w].loads for w in ("a", "b")] == [1, 1]
        assert mirror.reloads == 0
    await client.aclose()
