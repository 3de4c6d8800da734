"""KV cache events: what a worker's block pool did, as both sides see it.

The engine produces these plain dataclasses (no protobuf on its hot path);
the publisher wraps a step's worth into an ``EventBatch`` and encodes it with
the ``kv_events.proto`` schema; the gateway decodes it back. ``seq`` is
gap-free within an ``epoch`` (one boot of a worker), so a consumer can tell
when it missed something and must reload the worker's block set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contract import kv_events_pb2 as pb


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became cached (full and hashed), in chain order."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks whose cached content was evicted (their hash is gone from the pool)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The pool forgot every cached block (reset, restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """One publish: the events of one or more engine steps, in order."""

    worker_id: str
    epoch: str
    seq: int
    timestamp: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)


def encode_batch(batch: EventBatch) -> bytes:
    """Serializes a batch with the ``kvroute.v1.EventBatch`` protobuf schema."""
    msg = pb.EventBatch(
        worker_id=batch.worker_id, epoch=batch.epoch, seq=batch.seq, timestamp=batch.timestamp
    )
    for event in batch.events:
        item = msg.events.add()
        if isinstance(event, BlockStored):
            item.stored.block_hashes.extend(event.block_hashes)
            if event.parent_hash is not None:
                item.stored.parent_hash = event.parent_hash
        elif isinstance(event, BlockRemoved):
            item.removed.block_hashes.extend(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            item.cleared.SetInParent()
        else:
            raise TypeError(f"not a KV event: {event!r}")
    return msg.SerializeToString()


def decode_batch(data: bytes) -> EventBatch:
    """Parses bytes written by ``encode_batch``; raises ``ValueError`` on garbage."""
    msg = pb.EventBatch()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise ValueError(f"undecodable event batch: {exc}") from exc
    events: list[KVEvent] = []
    for item in msg.events:
        kind = item.WhichOneof("event")
        if kind == "stored":
            parent = item.stored.parent_hash if item.stored.HasField("parent_hash") else None
            events.append(BlockStored(tuple(item.stored.block_hashes), parent))
        elif kind == "removed":
            events.append(BlockRemoved(tuple(item.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError("event batch holds an empty event")
    return EventBatch(msg.worker_id, msg.epoch, msg.seq, msg.timestamp, tuple(events))
