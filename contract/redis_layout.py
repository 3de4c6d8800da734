"""Redis key names and value encodings shared by worker publishers and gateway mirrors.

All keys live under ``{namespace}:`` so several deployments can share one Redis:

- ``{ns}:workers`` — set of worker ids ever registered (a directory; liveness
  is the registry key below, never this set).
- ``{ns}:worker:{id}`` — hash: the worker's ``WorkerRecord``; written by the
  heartbeat with a TTL. Expired = dead: gateways drop the worker and its blocks.
- ``{ns}:blocks:{id}`` — set of decimal block hashes the worker holds now.
- ``{ns}:events:{id}`` — stream of ``EventBatch`` protobufs in field ``b``
  (capped; a gateway that falls behind the cap reloads the set).

A worker changes its block set and appends to its stream in one MULTI/EXEC, so
a gateway that reads the set and the stream's last id in one MULTI gets a
consistent snapshot to tail from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

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
        return f"{self.namespace}:worker:{worker_id}"

    def blocks(self, worker_id: str) -> str:
        return f"{self.namespace}:blocks:{worker_id}"

    def events(self, worker_id: str) -> str:
        return f"{self.namespace}:events:{worker_id}"


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
