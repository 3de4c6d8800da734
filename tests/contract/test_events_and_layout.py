"""Event wire format and Redis layout round-trips."""

from __future__ import annotations

import pytest

from contract.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from contract.redis_layout import RedisLayout, WorkerRecord


def test_event_batch_round_trip() -> None:
    batch = EventBatch(
        worker_id="w1",
        epoch="e1",
        seq=42,
        timestamp=1.5,
        events=(
            BlockStored((1, 2**64 - 1), parent_hash=7),
            BlockStored((3,)),
            BlockRemoved((1,)),
            AllBlocksCleared(),
        ),
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_garbage_raises_value_error() -> None:
    with pytest.raises(ValueError, match="undecodable"):
        decode_batch(b"\xff\xff\xff")


def test_encode_rejects_non_events() -> None:
    with pytest.raises(TypeError):
        encode_batch(EventBatch("w", "e", 0, 0.0, ("nope",)))  # type: ignore[arg-type]


def test_layout_keys_are_namespaced() -> None:
    layout = RedisLayout("prod-a")
    # One hash tag per worker: its three keys share a Redis Cluster slot.
    assert layout.worker("w1") == "prod-a:worker:{w1}"
    assert layout.blocks("w1") == "prod-a:blocks:{w1}"
    assert layout.events("w1") == "prod-a:events:{w1}"
    assert layout.workers == "prod-a:workers"
    with pytest.raises(ValueError, match="namespace"):
        RedisLayout("a:b")


def test_worker_record_round_trip() -> None:
    rec = WorkerRecord(
        worker_id="w1",
        address="127.0.0.1:5000",
        model="m",
        hash_spec={"block_size": 16, "model": "m"},
        num_blocks=100,
        epoch="abc",
        running=2,
        prefill_tokens_per_s=1234.5,
    )
    raw = {k.encode(): v.encode() for k, v in rec.to_mapping().items()}
    assert WorkerRecord.from_mapping(raw) == rec
    with pytest.raises(ValueError, match="malformed"):
        WorkerRecord.from_mapping({"worker_id": "w", "address": "a", "running": "x"})


async def test_layout_against_real_redis(redis_url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    layout = RedisLayout("t-layout")
    rec = WorkerRecord(worker_id="w1", address="a:1", epoch="e")
    await client.hset(layout.worker("w1"), mapping=rec.to_mapping())
    assert WorkerRecord.from_mapping(await client.hgetall(layout.worker("w1"))) == rec
    await client.delete(layout.worker("w1"))
    await client.aclose()


def test_block_set_buckets_round_trip_and_rewrite_only_what_changed() -> None:
    from contract.redis_layout import BlockSetWriter, bucket_bits, decode_block_set, pack_blocks

    assert bucket_bits(0) == 0 and bucket_bits(100_000) == 11  # ~48 hashes a bucket when full
    assert decode_block_set([pack_blocks([1, 2**64 - 1])]) == [1, 2**64 - 1]
    writer = BlockSetWriter()
    hashes = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 400)]
    fields = writer.reset(hashes, capacity=4096)
    assert writer.bits == 7 and 100 < len(fields) <= 128  # 32 a bucket when the pool is full
    assert sorted(decode_block_set(fields.values())) == sorted(hashes)
    write, delete = writer.change(added=[hashes[0], 5], removed=[hashes[1], 12345])
    # 5 is new (bucket 0), hashes[1] went; re-adding a member or removing a stranger is a no-op.
    touched = {str(hashes[1] >> 57), "0"}
    assert set(write) | set(delete) == touched
    fields.update(write)
    for f in delete:
        fields.pop(f)
    assert sorted(decode_block_set(fields.values())) == sorted({*hashes[:1], *hashes[2:], 5})
    assert writer.change(added=[5], removed=[12345]) == ({}, [])
    assert len(writer) == len(hashes)
