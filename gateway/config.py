"""The gateway's configuration: one frozen dataclass, built once by ``gateway.cli``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from contract.model_paths import SMOLLM2_ALIAS, is_smollm2_alias
from contract.redis_layout import DEFAULT_NAMESPACE, RedisLayout
from gateway.routing.router import RouterConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything ``create_app`` needs; each field mirrors a ``kvroute gateway`` flag."""

    model_dir: Path
    served_model_name: str = ""  # "" = the model folder's name
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_namespace: str = DEFAULT_NAMESPACE
    host: str = "0.0.0.0"
    port: int = 8000
    router: RouterConfig = field(default_factory=RouterConfig)
    session_ttl_s: float = 600.0
    speculative_ttl_s: float = 2.0  # 0 = no speculative index entries
    max_queue_per_worker: int = 0  # 0 = never answer 429
    request_timeout_s: float = 600.0
    first_token_timeout_s: float = 60.0  # silent before the first token: retry elsewhere
    inter_token_timeout_s: float = 30.0  # silent mid-stream: end it with an error event
    engine_stall_s: float = 5.0  # a heartbeat saying the engine has not stepped this long
    max_body_bytes: int = 4 * 1024 * 1024
    api_keys_file: Path | None = None
    tenant_salt_secret: str = field(default="", repr=False)  # HMAC key of tenant salts
    client_idle_timeout_s: float = 30.0  # idle, or still sending its headers: closed
    client_body_timeout_s: float = 60.0  # a request body still arriving after this: 408
    grpc_tls_ca: Path | None = None  # PEM CA bundle: dial workers over TLS
    # From --grpc-token-file: sent to every worker as "authorization: Bearer <token>".
    grpc_token: str = field(default="", repr=False)
    log_level: str = "info"
    access_log: bool = True  # one INFO line per request on the kvroute.access logger
    vllm_metrics: bool = False  # also export vllm:* aliases of the fleet-level metrics
    registry_poll_s: float = 0.5
    max_retries: int = 2  # other workers tried when one fails before its first token
    tokenizer_cache_entries: int = 1024
    tokenizer_cache_tokens: int = 8_000_000
    # Longer uncached suffixes are tokenized off the loop; 0 = by encoder (gateway.text.tokenizer).
    executor_min_chars: int = 0
    # Byte-level BPE ids from tiktoken's encoder where it gives HF's (gateway.text.fast_bpe).
    fast_bpe: bool = True
    index_max_entries: int = 0  # (worker, block) entries the index keeps; 0 = unbounded
    redis_cluster: bool = False  # --redis-url is a node of a Redis Cluster
    # Share in-flight load, speculative entries and sessions with the other gateway
    # replicas of this namespace through Redis (gateway.routing.replicas).
    replica_sync: bool = True
    # Tokens per worker message after the first (gRPC workers); 0 = auto (gateway.routing.jobs).
    stream_interval: int = 0
    # Requests to a gRPC worker ride one GenerateMany stream per worker (gateway.upstream.grpc_mux).
    grpc_mux: bool = True
    # ...on a worker's frames port (contract.frames) where it advertises one.
    worker_frames: bool = True
    # Processes serving one port (gateway.processes); the first owns the block index.
    processes: int = 1
    # The owner's index socket (gateway.routing.index_share): set for every process of
    # a multi-process gateway; ``index_owner`` marks the one that holds the index.
    index_socket: str = ""
    index_owner: bool = False

    def __post_init__(self) -> None:
        RedisLayout(self.redis_namespace)  # validates --redis-namespace
        checks = [
            (0 <= self.port <= 65535, "--port must be in [0, 65535]"),
            (self.session_ttl_s >= 0, "--session-ttl must be >= 0"),
            (self.speculative_ttl_s >= 0, "--speculative-ttl must be >= 0"),
            (0 <= self.stream_interval <= 64, "--stream-interval must be in [0, 64] (0 = auto)"),
            (self.max_queue_per_worker >= 0, "--max-queue-per-worker must be >= 0"),
            (self.request_timeout_s > 0, "--request-timeout must be > 0"),
            (self.first_token_timeout_s > 0, "--first-token-timeout must be > 0"),
            (self.inter_token_timeout_s > 0, "--inter-token-timeout must be > 0"),
            (self.engine_stall_s > 0, "--engine-stall-s must be > 0"),
            (self.client_idle_timeout_s > 0, "--client-idle-timeout must be > 0"),
            (self.client_body_timeout_s > 0, "--client-body-timeout must be > 0"),
            (self.max_body_bytes >= 1024, "--max-body-bytes must be >= 1024"),
            (
                self.grpc_tls_ca is None or self.grpc_tls_ca.is_file(),
                f"--grpc-tls-ca {self.grpc_tls_ca}: no such file",
            ),
            (self.log_level.lower() in LOG_LEVELS, f"--log-level: one of {LOG_LEVELS}"),
            (self.registry_poll_s > 0, "registry_poll_s must be > 0"),
            (self.max_retries >= 0, "max_retries must be >= 0"),
            (self.index_max_entries >= 0, "--index-max-entries must be >= 0"),
            (1 <= self.processes <= 256, "--processes must be in [0, 256] (0 = one per core)"),
            (
                self.processes == 1 or self.replica_sync,
                "--processes above 1 needs --replica-sync true: the processes share "
                "in-flight load and sessions as replicas do",
            ),
            (
                self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                "--redis-url must start with redis://, rediss:// or unix://",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @cached_property
    def model_names(self) -> tuple[str, ...]:
        """Every name clients may put in ``model``: ``--served-model-name`` (a comma- or
        space-separated list; default the folder's name), plus ``smollm2`` for its folder.

        Cached: every request checks its ``model`` against these, and resolving the
        folder's path is file-system calls (1.4 % of a gateway's CPU on a Mooncake replay)."""
        listed = tuple(n for n in self.served_model_name.replace(",", " ").split() if n)
        names = listed or (self.model_dir.resolve().name,)
        if not listed and is_smollm2_alias(names[0]):
            names += (SMOLLM2_ALIAS,)
        return names

    @property
    def model_name(self) -> str:
        """The primary served name (the first of ``model_names``)."""
        return self.model_names[0]

    @property
    def front(self) -> bool:
        """A process of a multi-process gateway that asks its owner for the index."""
        return bool(self.index_socket) and not self.index_owner

    @property
    def layout(self) -> RedisLayout:
        return RedisLayout(self.redis_namespace)
