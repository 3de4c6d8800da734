"""Redis key names and value encodings shared by worker publishers and gateway mirrors.

All keys live under ``{namespace}:`` so several deployments can share one Redis:

- ``{ns}:workers`` — set of worker ids ever registered (a directory; liveness
  is the registry key below, never this set).
- ``{ns}:worker:{<id>}`` — hash: the worker's ``WorkerRecord``; written by the
  heartbeat with a TTL. Expired = dead: gateways drop the worker and its blocks.
- ``{ns}:blocks:{<id>}`` — the block hashes the worker holds now, as a hash of
  *buckets*: field = bucket number (decimal, from the hash's top bits), value =
  the bucket's hashes as packed 8-byte little-endian integers. About 10 bytes
  of Redis memory per block, against 56 for a set of 8-byte strings and 72 for
  decimal ones (``loadtest.bench_scale`` measures it). The worker rewrites
  only the buckets a batch touched (``BlockSetWriter``); a reader takes
  ``HVALS`` and ``decode_block_set``.
- ``{ns}:events:{<id>}`` — stream of ``EventBatch`` protobufs in field ``b``
  (capped; a gateway that falls behind the cap reloads the set).
- ``{ns}:routes`` — stream the gateway replicas share routing decisions and
  in-flight load through (``gateway.routing.replicas``; capped).

The ``{<id>}`` in braces is a Redis Cluster hash tag: one worker's three keys
share a slot, so a worker changes its block set and appends to its stream in
one MULTI/EXEC on a single Redis or a Cluster. The directory lives in its own
slot and is never in a transaction with them. Worker ids may not contain braces.

A gateway reads a stream's last entry *before* the set (one pipeline, no
MULTI, so many workers load per round trip): events are idempotent set
operations, so replaying the stream from that entry onto a set that already
includes some later events converges to the same set.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields

import numpy as np

DEFAULT_NAMESPACE = "kvroute"
TRANSPORT_GRPC = "grpc"
TRANSPORT_OPENAI_HTTP = "openai-http"
TRANSPORTS = (TRANSPORT_GRPC, TRANSPORT_OPENAI_HTTP)
EVENT_FIELD = "b"
STREAM_MAXLEN = 10_000


@dataclass(frozen=True)
class RedisLayout:
    """Key names for one deployment's namespace."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in " :*?[]"):
            raise ValueError(f"--redis-namespace {self.namespace!r}: use letters, digits, -, _")

    @property
    def workers(self) -> str:
        return f"{self.namespace}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{{{worker_id}}}"

    def blocks(self, worker_id: str) -> str:
        return f"{self.namespace}:blocks:{{{worker_id}}}"

    def events(self, worker_id: str) -> str:
        return f"{self.namespace}:events:{{{worker_id}}}"

    @property
    def routes(self) -> str:
        """Stream the gateway replicas share their routing through (gateway.routing.replicas)."""
        return f"{self.namespace}:routes"


def valid_worker_id(worker_id: str) -> bool:
    """Whether ``worker_id`` can name keys (non-empty, no braces, no spaces)."""
    return bool(worker_id) and not any(c in worker_id for c in "{} \t\r\n")


# -- the block set: packed 8-byte hashes in buckets --------------------------------

BLOCK_BYTES = 8
_PER_BUCKET = 32  # hashes per bucket when the pool is full


def bucket_bits(capacity: int) -> int:
    """Top bits of a hash that pick its bucket, for a pool of ``capacity`` blocks."""
    return max(0, min(16, (max(0, capacity) // _PER_BUCKET).bit_length() - 1))


def pack_blocks(hashes: Iterable[int]) -> bytes:
    """Hashes as consecutive 8-byte little-endian unsigned integers."""
    return np.fromiter(hashes, dtype="<u8").tobytes()


def decode_block_set(values: Iterable[bytes]) -> list[int]:
    """The hashes in ``HVALS`` of a block-set key (values of any length % 8 are cut)."""
    data = b"".join(values)
    usable = len(data) - len(data) % BLOCK_BYTES
    return np.frombuffer(data[:usable], dtype="<u8").tolist()


class BlockSetWriter:
    """The writer's model of its bucketed block set: which fields a change rewrites.

    The worker owns its set, so it keeps the buckets in memory and writes each
    touched bucket whole (``HSET``, or ``HDEL`` when it empties): idempotent,
    and no read-modify-write in Redis.
    """

    def __init__(self) -> None:
        self.bits = 0
        self._buckets: dict[int, set[int]] = {}

    def _bucket(self, h: int) -> int:
        return h >> (64 - self.bits) if self.bits else 0

    def reset(self, hashes: Iterable[int], capacity: int) -> dict[str, bytes]:
        """Forgets everything, holds ``hashes``; returns every field to write."""
        self._buckets = {}
        hashes = list(hashes)
        self.bits = bucket_bits(max(capacity, len(hashes)))
        for h in hashes:
            self._buckets.setdefault(self._bucket(h), set()).add(h)
        return {str(b): pack_blocks(sorted(hs)) for b, hs in self._buckets.items()}

    def change(
        self, added: Iterable[int], removed: Iterable[int]
    ) -> tuple[dict[str, bytes], list[str]]:
        """Applies a delta; returns (fields to ``HSET``, fields to ``HDEL``)."""
        touched: set[int] = set()
        for h in removed:
            b = self._bucket(h)
            held = self._buckets.get(b)
            if held is not None and h in held:
                held.discard(h)
                touched.add(b)
        for h in added:
            b = self._bucket(h)
            held = self._buckets.setdefault(b, set())
            if h not in held:
                held.add(h)
                touched.add(b)
        write: dict[str, bytes] = {}
        delete: list[str] = []
        for b in sorted(touched):
            held = self._buckets[b]
            if held:
                write[str(b)] = pack_blocks(sorted(held))
            else:
                del self._buckets[b]
                delete.append(str(b))
        return write, delete

    def __len__(self) -> int:
        return sum(len(hs) for hs in self._buckets.values())


@dataclass(frozen=True)
class WorkerRecord:
    """A worker's registry entry: identity, capacity and current load."""

    worker_id: str
    address: str  # how the gateway reaches it: gRPC host:port, or the base URL for openai-http
    http_address: str = ""  # OpenAI-compatible HTTP front host:port
    model: str = ""
    hash_spec: dict[str, str | int] = field(default_factory=dict)
    block_size: int = 16
    num_blocks: int = 0
    max_model_len: int = 0
    epoch: str = ""
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    updated_at: float = 0.0
    # Added with the vLLM bridge; records written before decode with these defaults.
    transport: str = TRANSPORT_GRPC  # "grpc" (kvroute's engine) | "openai-http" (vLLM)
    http_url: str = ""  # base URL of an openai-http worker's API, e.g. http://10.0.0.5:8000
    tokenizer_fingerprint: str = ""  # contract.tokenizer_probe.fingerprint; "" = not checked
    # host:port of the worker's plain-TCP GenerateMany (contract.frames); "" = gRPC only.
    frames_address: str = ""
    # Seconds since the engine thread last went round its loop, at ``updated_at``:
    # a live heartbeat over a stuck engine still tells gateways to stop routing here.
    engine_step_age_s: float = 0.0
    # How the worker's GenerateRequest may carry the prompt (contract.prompt_wire):
    # "le32" = it reads prompt_token_ids_le32 too; "" = packed varints only.
    prompt_encoding: str = ""

    def to_mapping(self) -> dict[str, str]:
        """Flat string values for ``HSET``."""
        out = {}
        for key, value in asdict(self).items():
            out[key] = json.dumps(value) if isinstance(value, dict) else str(value)
        return out

    @classmethod
    def from_mapping(cls, raw: Mapping[bytes | str, bytes | str]) -> WorkerRecord:
        """Parses an ``HGETALL`` result; raises ``ValueError`` if a field is malformed."""
        data = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        kwargs: dict[str, object] = {}
        try:
            for f in fields(cls):
                if f.name not in data:
                    continue
                value = data[f.name]
                if f.name == "hash_spec":
                    kwargs[f.name] = json.loads(value)
                elif f.type in ("int", int):
                    kwargs[f.name] = int(value)
                elif f.type in ("float", float):
                    kwargs[f.name] = float(value)
                else:
                    kwargs[f.name] = value
            record = cls(**kwargs)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed worker record: {exc}") from exc
        if record.transport not in TRANSPORTS:
            raise ValueError(f"malformed worker record: unknown transport {record.transport!r}")
        return record
