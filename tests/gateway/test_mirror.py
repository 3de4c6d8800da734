"""IndexMirror against a real Redis: discovery, load, tail, reloads, death, outages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from contract.events import AllBlocksCleared, BlockStored
from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout
from gateway.routing.index import BlockIndex
from gateway.routing.mirror import IndexMirror
from tests.gateway.fakes import FakeRegistration
from tests.gateway.helpers import eventually, namespace, running
from tests.support import RedisProcess

SPEC = HashSpec(block_size=4, model="m")


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def make(redis_url: str) -> tuple[IndexMirror, RedisLayout, list[str]]:
    layout = RedisLayout(namespace())
    dropped: list[str] = []
    mirror = IndexMirror(redis_url, layout, BlockIndex(), poll_s=0.05, on_drop=dropped.append)
    return mirror, layout, dropped


async def test_loads_existing_then_tails(redis_url: str, redis_client: aioredis.Redis) -> None:
    mirror, layout, _ = make(redis_url)
    reg = FakeRegistration(redis_client, layout, "w1", "127.0.0.1:1", SPEC)
    await reg.register()
    await reg.store([10, 11, 12])
    async with running(mirror):
        await eventually(lambda: mirror.index.block_count("w1") == 3, what="snapshot")
        assert mirror.workers["w1"].spec == SPEC
        await reg.store([13])
        await eventually(lambda: mirror.index.longest_prefix([10, 11, 12, 13]) == {"w1": 4})
        await reg.remove([11])
        await eventually(lambda: mirror.index.longest_prefix([10, 11, 12]) == {"w1": 1})
        await reg.publish([AllBlocksCleared(), BlockStored((7, 8))])
        await eventually(lambda: mirror.index.longest_prefix([7, 8]) == {"w1": 2})
        assert mirror.index.block_count("w1") == 2
        assert mirror.workers["w1"].seq == reg.seq - 1
        assert 0 <= mirror.workers["w1"].event_lag_s < 5


async def test_seq_gap_reloads_the_set(redis_url: str, redis_client: aioredis.Redis) -> None:
    mirror, layout, _ = make(redis_url)
    reg = FakeRegistration(redis_client, layout, "w1", "127.0.0.1:1", SPEC)
    await reg.register()
    await reg.store([1])
    async with running(mirror):
        await eventually(lambda: mirror.index.block_count("w1") == 1)
        # A lost batch: the set has 2 and 3, but no event said so.
        await reg.publish([BlockStored((2, 3))], touch_stream=False)
        await reg.publish([BlockStored((4,))], seq=reg.seq + 1)
        await eventually(
            lambda: mirror.index.longest_prefix([1, 2, 3, 4]) == {"w1": 4}, what="reload after gap"
        )


async def test_new_epoch_reloads(redis_url: str, redis_client: aioredis.Redis) -> None:
    mirror, layout, _ = make(redis_url)
    reg = FakeRegistration(redis_client, layout, "w1", "127.0.0.1:1", SPEC)
    await reg.register()
    await reg.store([1, 2])
    async with running(mirror):
        await eventually(lambda: mirror.index.block_count("w1") == 2)
        # The worker restarted: new epoch, fresh set, stream restarted at seq 0.
        await redis_client.delete(layout.blocks("w1"), layout.events("w1"))
        reg.seq = 0
        await reg.register(epoch="epoch-2")
        await reg.publish([AllBlocksCleared(), BlockStored((5,))], epoch="epoch-2")
        await eventually(
            lambda: (
                mirror.index.longest_prefix([5]) == {"w1": 1}
                and mirror.index.block_count("w1") == 1
                and mirror.workers["w1"].loaded
                and mirror.workers["w1"].record.epoch == "epoch-2"
            ),
            what="epoch reload",
        )
        assert mirror.workers["w1"].epoch == "epoch-2"


async def test_every_heartbeat_updates_the_load(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    # A bridged vLLM worker's record says 0 for engine_step_age_s on every heartbeat:
    # only updated_at tells one heartbeat from the next.
    mirror, layout, _ = make(redis_url)
    reg = FakeRegistration(redis_client, layout, "w1", "127.0.0.1:1", SPEC)
    await reg.register(running=1, engine_step_age_s=0.0)
    async with running(mirror):
        await eventually(lambda: "w1" in mirror.workers, what="discovery")

        def load_seen() -> tuple[int, int, int]:
            record = mirror.workers["w1"].record
            return record.running, record.waiting, record.free_blocks

        for running_, waiting in ((4, 2), (0, 0)):
            await reg.register(
                engine_step_age_s=0.0, free_blocks=7, running=running_, waiting=waiting
            )
            await eventually(
                lambda expected=(running_, waiting, 7): load_seen() == expected,
                what=f"heartbeat {running_}, {waiting}",
            )


async def test_expired_registry_key_drops_worker(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    mirror, layout, dropped = make(redis_url)
    regs = [FakeRegistration(redis_client, layout, w, "127.0.0.1:1", SPEC) for w in ("a", "b")]
    for reg in regs:
        await reg.register()
        await reg.store([1, 2])
    async with running(mirror):
        await eventually(lambda: mirror.index.longest_prefix([1, 2]) == {"a": 2, "b": 2})
        await regs[0].expire()
        await eventually(lambda: "a" not in mirror.workers, what="drop")
        assert dropped == ["a"]
        assert mirror.index.longest_prefix([1, 2]) == {"b": 2}
        assert mirror.index.workers() == ["b"]


async def test_malformed_and_foreign_records(redis_url: str, redis_client: aioredis.Redis) -> None:
    mirror, layout, _ = make(redis_url)
    await redis_client.sadd(layout.workers, "bad")
    await redis_client.hset(
        layout.worker("bad"),
        mapping={"worker_id": "bad", "address": "x", "block_size": "not-a-number"},
    )
    other = FakeRegistration(redis_client, layout, "old", "127.0.0.1:1", SPEC)
    other.record = replace(other.record, hash_spec={"version": "v0", "block_size": 4})
    await other.register()
    async with running(mirror):
        await eventually(lambda: "old" in mirror.workers)
        assert "bad" not in mirror.workers
        assert mirror.workers["old"].spec is None  # routable, but never a cache hit


async def test_redis_outage_keeps_mirror_and_reloads(redis_process: RedisProcess) -> None:
    mirror, layout, _ = make(redis_process.url)
    client = aioredis.Redis.from_url(redis_process.url)
    reg = FakeRegistration(client, layout, "w1", "127.0.0.1:1", SPEC)
    await reg.register()
    await reg.store([1, 2, 3])
    async with running(mirror):
        await eventually(lambda: mirror.index.block_count("w1") == 3 and mirror.redis_ok)
        await client.aclose()
        redis_process.stop(kill=True)
        await eventually(lambda: not mirror.redis_ok, what="outage noticed")
        assert mirror.index.longest_prefix([1, 2, 3]) == {"w1": 3}  # still serving
        assert mirror.has_snapshot
        redis_process.start()  # an empty Redis: the worker re-registers with what it holds now
        client = aioredis.Redis.from_url(redis_process.url)
        reg.client = client
        reg.seq = 0
        reg.blockset.reset((), 0)  # it writes its set anew into the empty Redis
        await reg.register()
        await reg.store([1, 9])
        await eventually(
            lambda: mirror.redis_ok and mirror.index.block_count("w1") == 2,
            timeout=10,
            what="reload after reconnect",
        )
        assert mirror.index.longest_prefix([1, 9]) == {"w1": 2}
        assert mirror.reconnects >= 1
    await client.aclose()


async def test_a_whole_fleet_vanishing_is_held_as_redis_trouble(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    """Every key gone in one poll (a full Redis refusing heartbeats) keeps the fleet for
    the grace, counted once; one key gone is a death; deregistered workers leave at once."""
    layout = RedisLayout(namespace())
    dropped: list[str] = []
    metrics = CollectorRegistry()
    mirror = IndexMirror(
        redis_url,
        layout,
        BlockIndex(),
        poll_s=0.05,
        on_drop=dropped.append,
        fleet_loss_grace_s=1.0,
        registry=metrics,
    )

    def held() -> float | None:
        return metrics.get_sample_value("kvroute_gateway_registry_held_workers")

    def vanished() -> float | None:
        return metrics.get_sample_value("kvroute_gateway_registry_fleet_vanished_total")

    regs = [FakeRegistration(redis_client, layout, w, "127.0.0.1:1", SPEC) for w in "abc"]
    for reg in regs:
        await reg.register()
        await reg.store([1, 2])
    async with running(mirror):
        await eventually(lambda: len(mirror.index.longest_prefix([1, 2])) == 3)
        await regs[2].expire()  # one death: dropped as before
        await eventually(lambda: dropped == ["c"], what="one worker's death")
        for reg in regs[:2]:
            await reg.expire()
        await asyncio.sleep(0.5)  # ten polls, within the grace
        assert sorted(mirror.workers) == ["a", "b"] and dropped == ["c"]
        assert mirror.index.longest_prefix([1, 2]) == {"a": 2, "b": 2}
        assert held() == 2
        assert vanished() == 1
        await regs[0].register()  # Redis takes writes again: b's key is still gone
        await eventually(lambda: dropped == ["c", "b"], what="held fleet released")
        assert held() == 0
        await regs[0].register()
        await regs[1].register()
        await eventually(lambda: sorted(mirror.workers) == ["a", "b"], what="b back")
        for reg in regs[:2]:
            await reg.expire()
        await asyncio.sleep(0.5)
        assert sorted(mirror.workers) == ["a", "b"]  # held again, a second vanishing
        await eventually(lambda: not mirror.workers, timeout=3, what="grace over")
        assert vanished() == 2
        assert held() == 0
        # Deregistered workers (gone from the directory as well) are never held.
        for reg in regs[:2]:
            await reg.register()
        await eventually(lambda: sorted(mirror.workers) == ["a", "b"], what="both back")
        for reg in regs[:2]:
            await reg.expire()
            await redis_client.srem(layout.workers, reg.worker_id)
        await eventually(lambda: not mirror.workers, timeout=0.5, what="deregistered drop")
        assert vanished() == 2
