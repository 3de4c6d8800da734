"""Decodes an engine's ZMQ KV-event frames into engine-neutral events (the adapters).

vLLM publishes ``[topic, seq (8-byte big-endian), payload]``; the payload is
msgpack of ``KVEventBatch`` = ``[ts, events, data_parallel_rank]``. vLLM 0.32
encodes each event as a map tagged by ``type``; older vLLM and SGLang encode
it as an array ``[tag, field, ...]`` in declaration order. The replay socket
prefixes the same three frames with an empty delimiter and ends with seq -1.

Only what the bridge needs survives decoding: the engine's block hashes (to
pair removals with stores), the parent hash, the token ids, the block size and
what enters kvroute's hash seed (LoRA name, cache salt). Events for other
media (a CPU offload tier) or other KV-cache groups are dropped here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

END_SEQ = -1
ENGINES = ("vllm", "sglang")

# Array-encoded field order after the tag (older vLLM, SGLang).
_ARRAY_FIELDS = {
    "vllm": {
        "BlockStored": (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
        ),
        "BlockRemoved": ("block_hashes", "medium", "group_idx"),
        "AllBlocksCleared": (),
    },
    # SGLang (sglang/srt/disaggregation/kv_events.py): no lora_name/extra_keys/group_idx.
    "sglang": {
        "BlockStored": (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
        ),
        "BlockRemoved": ("block_hashes", "medium"),
        "AllBlocksCleared": (),
    },
}
# The device tier; SGLang names its host tier CPU_PINNED, vLLM's offload tier is CPU.
_DEVICE_MEDIA = (None, "GPU")

EngineHash = int | bytes


@dataclass(frozen=True)
class StoredBlocks:
    """Blocks the engine cached, in chain order, with their tokens."""

    block_hashes: tuple[EngineHash, ...]
    parent_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    cache_salt: str = ""


@dataclass(frozen=True)
class RemovedBlocks:
    """Blocks the engine evicted (one physical copy each)."""

    block_hashes: tuple[EngineHash, ...]


@dataclass(frozen=True)
class ClearedBlocks:
    """The engine dropped its whole prefix cache."""


EngineEvent = StoredBlocks | RemovedBlocks | ClearedBlocks


@dataclass(frozen=True)
class EngineBatch:
    """One published batch: an engine step's events under one sequence number."""

    seq: int
    timestamp: float
    events: tuple[EngineEvent, ...]


def _fields(engine: str, raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        return str(raw.get("type", "")), raw
    if isinstance(raw, (list, tuple)) and raw:
        tag = str(raw[0])
        names = _ARRAY_FIELDS[engine].get(tag, ())
        return tag, dict(zip(names, raw[1:], strict=False))
    raise ValueError(f"not a KV event: {raw!r}")


def _salt(extra_keys: Any, lora_name: str) -> str:
    """The cache salt vLLM folds into block 0's extra keys (a plain string entry).

    Block 0's entry lists, in order, the LoRA name (if any), multimodal
    ``(id, offset)`` pairs, the cache salt and prompt-embedding digests (bytes).
    """
    if not isinstance(extra_keys, (list, tuple)) or not extra_keys:
        return ""
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return ""
    items = list(first)
    if lora_name and items and items[0] == lora_name:
        items = items[1:]
    strings = [x for x in items if isinstance(x, str)]
    return strings[0] if strings else ""


def decode_event(raw: Any, engine: str = "vllm") -> EngineEvent | None:
    """One event, or None when it is not about the device tier's prefix cache."""
    tag, f = _fields(engine, raw)
    if tag == "AllBlocksCleared":
        return ClearedBlocks()
    if f.get("medium") not in _DEVICE_MEDIA or f.get("group_idx") not in (None, 0):
        return None
    if tag == "BlockRemoved":
        return RemovedBlocks(tuple(f.get("block_hashes") or ()))
    if tag == "BlockStored":
        lora_name = f.get("lora_name") or ""
        if not lora_name and f.get("lora_id") is not None:
            lora_name = str(f["lora_id"])
        parent = f.get("parent_block_hash")
        return StoredBlocks(
            block_hashes=tuple(f.get("block_hashes") or ()),
            parent_hash=parent,
            token_ids=tuple(int(t) for t in f.get("token_ids") or ()),
            block_size=int(f.get("block_size") or 0),
            lora_name=str(lora_name),
            cache_salt=_salt(f.get("extra_keys"), str(lora_name)) if parent is None else "",
        )
    raise ValueError(f"unknown KV event type {tag!r}")


def decode_payload(seq: int, payload: bytes, engine: str = "vllm") -> EngineBatch:
    """A msgpack ``KVEventBatch`` payload; raises ``ValueError`` on garbage."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"undecodable KV event batch: {exc}") from exc
    if isinstance(obj, dict):  # a map-encoded batch (not seen from vLLM 0.32, cheap to accept)
        ts, events = obj.get("ts", 0.0), obj.get("events", [])
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
    else:
        raise ValueError(f"not a KV event batch: {obj!r}")
    decoded = (decode_event(e, engine) for e in events)
    return EngineBatch(seq, float(ts), tuple(e for e in decoded if e is not None))


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def parse_published(frames: Sequence[bytes], engine: str = "vllm") -> EngineBatch:
    """``[topic, seq, payload]`` from the PUB socket."""
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_payload(_seq(frames[1]), frames[2], engine)


def parse_replayed(frames: Sequence[bytes], engine: str = "vllm") -> EngineBatch | None:
    """``[b"", topic, seq, payload]`` from the replay socket; None at the end marker."""
    if len(frames) != 4:
        raise ValueError(f"expected 4 replay frames, got {len(frames)}")
    seq = _seq(frames[2])
    if seq == END_SEQ:
        return None
    return decode_payload(seq, frames[3], engine)
