"""The worker's configuration: one frozen dataclass, built once from CLI flags.

Every flag ``--foo-bar`` falls back to the environment variable
``KVROUTE_FOO_BAR`` and then to the dataclass default, so a Helm chart can set
everything through env. ``WorkerConfig.validate`` raises ``ValueError`` naming
the offending flag; nothing else in the worker re-checks these values.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from contract.grpc_auth import read_token_file
from contract.model_paths import served_model_name
from contract.redis_layout import DEFAULT_NAMESPACE, RedisLayout
from contract.redis_url import PASSWORD_ENV, with_password

ENV_PREFIX = "KVROUTE_"
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
KV_CACHE_DTYPES = ("auto", "fp8")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
ENGINES = ("torch", "emulated")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to know, resolved and validated."""

    model: str
    served_model_name: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_namespace: str = DEFAULT_NAMESPACE
    redis_cluster: bool = False  # --redis-url is a node of a Redis Cluster
    worker_id: str = ""
    host: str = "0.0.0.0"
    advertise_host: str = ""
    grpc_port: int = 50051
    http_port: int = 8001  # 0 = no HTTP front; not 8000, the gateway's default
    frames_port: int = 0  # 0 = off; else GenerateMany on plain TCP here (contract.frames)
    block_size: int = 16
    num_blocks: int | None = None  # None = size the pool from --memory-fraction
    memory_fraction: float | None = None
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's, capped by the pool
    stream_interval: int = 1  # tokens a stream holds before sending (vLLM's flag); 1 = none
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 3.0
    pin_system_prompt: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_level: str = "INFO"
    vllm_metrics: bool = False  # also export vllm:* aliases of the fleet-level metrics
    engine: str = "torch"  # "emulated": a benchmark instrument, see worker/model/emulated.py
    profile: str = ""  # the emulated engine's time model (a name in worker/model/profiles)
    emulated_time_scale: float = 1.0
    # SIGTERM: deregister, then finish in-flight requests up to this long (the
    # chart's terminationGracePeriodSeconds; Kubernetes kills the pod after it).
    drain_grace_s: float = 60.0
    trust_body_salt: bool = False  # the HTTP front honours a body's cache_salt
    engine_stall_s: float = 10.0  # /health fails when the engine has not stepped this long
    # From --grpc-token-file, read once: every gRPC call and HTTP request (probes and
    # /metrics aside) must carry "authorization: Bearer <token>". "" = no auth.
    grpc_token: str = field(default="", repr=False)

    def validate(self) -> WorkerConfig:
        """Returns ``self`` or raises ``ValueError`` naming the flag that is wrong."""
        if not self.model:
            raise ValueError("--model is required (a model folder, a .gguf file or 'smollm2')")
        if not self.served_model_name or any(c.isspace() for c in self.served_model_name):
            raise ValueError(f"--served-model-name {self.served_model_name!r}: no whitespace")
        if not self.worker_id or any(c in self.worker_id for c in " :*?[]"):
            raise ValueError(f"--worker-id {self.worker_id!r}: use letters, digits, ., -, _")
        if not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"--redis-url {self.redis_url!r}: must start with redis://, rediss:// or unix://"
            )
        RedisLayout(self.redis_namespace)  # raises naming --redis-namespace
        ports = (
            ("--grpc-port", self.grpc_port),
            ("--http-port", self.http_port),
            ("--frames-port", self.frames_port),
        )
        for flag, port in ports:
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} {port}: must be in 0..65535")
        if self.frames_port and self.frames_port in (self.grpc_port, self.http_port):
            raise ValueError(f"--frames-port {self.frames_port}: already the gRPC or HTTP port")
        if self.frames_port and (self.tls_cert is not None or self.grpc_token):
            raise ValueError(
                "--frames-port: the frames stream has neither TLS nor a token check; with "
                "--tls-cert or --grpc-token-file gateways reach this worker over gRPC only"
            )
        _positive("--block-size", self.block_size)
        if self.num_blocks is not None:
            _positive("--num-blocks", self.num_blocks)
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"--memory-fraction {self.memory_fraction}: must be in (0, 1]")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device {self.device!r}: use cpu, cuda or cuda:N")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"--dtype {self.dtype!r}: use float32, bfloat16 or float16")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: use auto or fp8")
        _positive("--max-num-seqs", self.max_num_seqs)
        _positive("--max-batch-tokens", self.max_batch_tokens)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len {self.max_model_len}: must be at least 2")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval {self.stream_interval}: must be at least 1")
        _positive("--heartbeat-interval", self.heartbeat_interval)
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError(
                f"--heartbeat-ttl {self.heartbeat_ttl}: must exceed "
                f"--heartbeat-interval {self.heartbeat_interval}"
            )
        if self.pin_system_prompt is not None and not self.pin_system_prompt.is_file():
            raise ValueError(f"--pin-system-prompt {self.pin_system_prompt}: no such file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: use torch or emulated")
        if self.engine == "emulated" and not self.profile:
            raise ValueError("--profile is required with --engine emulated")
        if self.engine != "emulated" and self.profile:
            raise ValueError("--profile needs --engine emulated")
        _positive("--emulated-time-scale", self.emulated_time_scale)
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s {self.drain_grace_s}: must be >= 0")
        _positive("--engine-stall-s", self.engine_stall_s)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        return self

    @property
    def advertised_host(self) -> str:
        """The host other machines dial: --advertise-host, else --host unless it is a wildcard.

        For a wildcard bind it is this host's resolved address (a pod IP in
        Kubernetes), falling back to loopback when the hostname does not resolve.
        """
        if self.advertise_host:
            return self.advertise_host
        if self.host not in ("0.0.0.0", "::", ""):
            return self.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def default_served_name(model: str) -> str:
    """The name a model is served under when --served-model-name is not given."""
    return served_model_name(model)


def _positive(flag: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{flag} {value}: must be positive")


def _optional_path(raw: str) -> Path | None:
    return Path(raw).expanduser() if raw else None


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError("use true or false")
    return lowered in ("true", "1", "yes")


def _dtype(raw: str) -> str:
    return DTYPES.get(raw.lower(), raw)


def _token_file(raw: str) -> str:
    return read_token_file(Path(raw).expanduser())


# flag -> (field, converter, help). The converter turns a CLI or env string into the value.
_FLAGS: dict[str, tuple[str, Callable[[str], object], str]] = {
    "--model": ("model", str, "model folder, .gguf file, or the alias smollm2"),
    "--served-model-name": (
        "served_model_name",
        str,
        "model name in the API and the hash seed (default: folder name)",
    ),
    "--redis-url": ("redis_url", str, "redis://[:password@]host:port/db or rediss://..."),
    "--redis-namespace": ("redis_namespace", str, "key prefix shared with the gateways"),
    "--redis-cluster": ("redis_cluster", _bool, "true: --redis-url is a node of a Redis Cluster"),
    "--worker-id": ("worker_id", str, "unique worker id (default: hostname-pid)"),
    "--host": ("host", str, "interface to bind"),
    "--advertise-host": (
        "advertise_host",
        str,
        "host gateways dial (default: --host, or this host's address)",
    ),
    "--grpc-port": ("grpc_port", int, "gRPC port (0 = any free port)"),
    "--http-port": ("http_port", int, "OpenAI-compatible HTTP port (0 = off)"),
    "--frames-port": (
        "frames_port",
        int,
        "also serve gateways' request stream as length-prefixed protobuf on plain TCP here, "
        "~8x cheaper for a gateway than gRPC (0 = off; not with TLS or a token)",
    ),
    "--block-size": ("block_size", int, "tokens per KV block (must match the gateways)"),
    "--num-blocks": ("num_blocks", int, "KV blocks in the pool (default: from memory)"),
    "--memory-fraction": ("memory_fraction", float, "share of device memory for the KV cache"),
    "--device": ("device", str, "cpu or cuda[:N]"),
    "--dtype": ("dtype", _dtype, "float32, bfloat16 or float16"),
    "--kv-cache-dtype": ("kv_cache_dtype", str, "auto or fp8"),
    "--max-num-seqs": ("max_num_seqs", int, "most sequences running at once"),
    "--max-batch-tokens": ("max_batch_tokens", int, "token budget of one engine step"),
    "--max-model-len": ("max_model_len", int, "longest sequence (default: the model's)"),
    "--stream-interval": (
        "stream_interval",
        int,
        "send a stream's tokens every N tokens (the first and the last at once); 1 sends "
        "each step's, and a reader that falls behind gets what piled up in one message",
    ),
    "--heartbeat-interval": ("heartbeat_interval", float, "seconds between registry heartbeats"),
    "--heartbeat-ttl": ("heartbeat_ttl", float, "registry key TTL in seconds"),
    "--pin-system-prompt": (
        "pin_system_prompt",
        _optional_path,
        "file whose text, as a system message, stays cached forever",
    ),
    "--tls-cert": ("tls_cert", _optional_path, "PEM certificate for gRPC TLS"),
    "--tls-key": ("tls_key", _optional_path, "PEM private key for gRPC TLS"),
    "--log-level": ("log_level", str.upper, "DEBUG, INFO, WARNING or ERROR"),
    "--vllm-metrics": (
        "vllm_metrics",
        _bool,
        "true: also export vLLM-named metrics (vllm:prompt_tokens_total, ...) on /metrics",
    ),
    "--engine": ("engine", str, "torch, or emulated (a time model, for routing benchmarks)"),
    "--profile": ("profile", str, "emulated engine profile: a name in worker/model/profiles"),
    "--emulated-time-scale": (
        "emulated_time_scale",
        float,
        "emulated engine: multiply every step's time (slow a GPU profile down to fit a CPU)",
    ),
    "--drain-grace-s": (
        "drain_grace_s",
        float,
        "on SIGTERM: deregister, then finish in-flight requests for up to this many seconds "
        "(set it to the pod's terminationGracePeriodSeconds)",
    ),
    "--trust-body-salt": (
        "trust_body_salt",
        _bool,
        "true: the HTTP front honours cache_salt in a request body (only when nothing "
        "untrusted can reach the port; otherwise tenants could probe each other's cache)",
    ),
    "--engine-stall-s": (
        "engine_stall_s",
        float,
        "health checks fail when the engine thread has not stepped for this many seconds",
    ),
    "--grpc-token-file": (
        "grpc_token",
        _token_file,
        "file holding the fleet's shared token: gRPC calls and HTTP requests without "
        "'authorization: Bearer <token>' are refused (probes and /metrics stay open)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``kvroute worker`` flags; each also reads ``KVROUTE_<FLAG>`` from the environment."""
    parser = argparse.ArgumentParser(
        prog="kvroute worker",
        description="A paged-KV prefix-caching inference worker that announces its cache "
        "in Redis. Every flag --foo-bar also reads env KVROUTE_FOO_BAR.",
    )
    defaults = {f.name: f.default for f in fields(WorkerConfig) if f.default is not MISSING}
    for flag, (name, _conv, text) in _FLAGS.items():
        default = defaults.get(name)
        shown = f", default {default}" if default not in (None, "") else ""
        parser.add_argument(
            flag,
            dest=name,  # the field; --grpc-token-file fills grpc_token
            default=None,
            help=f"{text} [env {env_name(flag)}{shown}]",
            metavar=flag[2:].upper().replace("-", "_"),
        )
    return parser


def env_name(flag: str) -> str:
    """``--redis-url`` -> ``KVROUTE_REDIS_URL``."""
    return ENV_PREFIX + flag[2:].upper().replace("-", "_")


def config_from_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerConfig:
    """Parses flags (env fallback), fills derived defaults, validates.

    Raises ``ValueError`` for bad values; argparse itself exits on unknown flags.
    """
    env = os.environ if env is None else env
    parsed = vars(build_parser().parse_args(list(argv)))
    values: dict[str, object] = {}
    for flag, (name, conv, _text) in _FLAGS.items():
        raw = parsed[name]
        if raw is None:
            raw = env.get(env_name(flag))
        if raw is None or raw == "":
            continue
        try:
            values[name] = conv(raw)
        except ValueError as exc:
            raise ValueError(f"{flag} {raw!r}: {exc}") from exc
    if "model" not in values:
        raise ValueError("--model is required (a model folder, a .gguf file or 'smollm2')")
    model = str(values["model"])
    values.setdefault("served_model_name", default_served_name(model))
    values.setdefault("worker_id", f"{socket.gethostname()}-{os.getpid()}")
    if env.get(PASSWORD_ENV):
        url = str(values.get("redis_url", WorkerConfig.redis_url))
        values["redis_url"] = with_password(url, env[PASSWORD_ENV])
    known = {f.name for f in fields(WorkerConfig)}
    return WorkerConfig(**{k: v for k, v in values.items() if k in known}).validate()  # type: ignore[arg-type]
