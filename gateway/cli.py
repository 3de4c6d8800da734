"""``kvroute gateway``: flags (with ``KVROUTE_*`` environment fallback) to a running server.

Every flag can also come from the environment: ``--redis-url`` from
``KVROUTE_REDIS_URL``, ``--balance-factor`` from ``KVROUTE_BALANCE_FACTOR``,
and so on. The server runs on uvloop until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from contract.grpc_auth import read_token_file
from contract.redis_url import PASSWORD_ENV, with_password
from gateway.config import LOG_LEVELS, GatewayConfig
from gateway.processes import FrontProcesses, usable_cores
from gateway.routing.router import POLICIES, RouterConfig
from gateway.text.tokenizer_folder import resolve_model_dir

logger = logging.getLogger(__name__)

# flag, type, default, help
_FLAGS: list[tuple[str, Callable[[str], Any] | str, Any, str]] = [
    ("--model", str, None, "model folder (tokenizer + chat template) or the alias smollm2"),
    (
        "--served-model-name",
        str,
        "",
        "the names clients use, comma-separated (default: the folder's name)",
    ),
    ("--redis-url", str, "redis://127.0.0.1:6379/0", "Redis with the workers' registry"),
    ("--redis-namespace", str, "kvroute", "key prefix shared with the workers"),
    ("--host", str, "0.0.0.0", "address to listen on"),
    ("--port", int, 8000, "port to listen on"),
    ("--policy", str, "kvroute", "routing policy: " + ", ".join(POLICIES)),
    (
        "--balance-factor",
        float,
        RouterConfig.balance_factor,
        "bounded load: skip workers whose queue is above this x the mean",
    ),
    (
        "--recompute-weight",
        float,
        RouterConfig.recompute_weight,
        "fleet cost of a duplicated prompt token vs a queued one",
    ),
    (
        "--shared-fill-gain",
        float,
        RouterConfig.shared_fill_gain,
        "how many times the cache-fill gap counts for a prefix many requests want (1 = as for one)",
    ),
    ("--session-ttl", float, 600.0, "seconds a session stays pinned after its last request"),
    (
        "--speculative-ttl",
        float,
        2.0,
        "seconds a routed prompt counts as cached after its first token (and while it waits; 0 = off)",
    ),
    ("--max-queue-per-worker", int, 0, "answer 429 when every worker queues this many (0 = off)"),
    ("--request-timeout", float, 600.0, "seconds a request may take end to end"),
    ("--max-body-bytes", int, 4 * 1024 * 1024, "largest accepted request body (413 above)"),
    (
        "--first-token-timeout",
        float,
        60.0,
        "seconds to wait for a worker's first token before retrying on another",
    ),
    (
        "--inter-token-timeout",
        float,
        30.0,
        "seconds a streaming worker may stay silent before the stream ends with an error",
    ),
    (
        "--engine-stall-s",
        float,
        5.0,
        "skip workers whose heartbeat says the engine has not stepped for this long",
    ),
    ("--api-keys-file", str, "", "JSON of bearer key -> tenant (optional)"),
    (
        "--client-idle-timeout",
        float,
        30.0,
        "seconds a client connection may sit idle or spend sending its headers (slowloris)",
    ),
    (
        "--client-body-timeout",
        float,
        60.0,
        "seconds a request body may take to arrive (408 after)",
    ),
    (
        "--tenant-salt-secret",
        str,
        "",
        "HMAC key for tenants' cache salts; prefer the env var (same on every replica)",
    ),
    ("--grpc-tls-ca", str, "", "PEM CA bundle: dial workers over gRPC TLS (optional)"),
    (
        "--grpc-token-file",
        str,
        "",
        "file with the fleet's shared token, sent on every call to a worker (workers "
        "started with the same file refuse calls without it)",
    ),
    ("--log-level", str, "info", "one of " + ", ".join(LOG_LEVELS)),
    ("--access-log", "bool", "true", "one INFO line per request (logger kvroute.access)"),
    ("--vllm-metrics", "bool", "false", "also export vLLM-named metrics (vllm:*) on /metrics"),
    ("--index-max-entries", int, 0, "memory bound: (worker, block) entries kept (0 = all)"),
    ("--redis-cluster", str, "false", "true: --redis-url is a node of a Redis Cluster"),
    (
        "--stream-interval",
        int,
        0,
        "tokens per worker message after the first; 0 = auto (1, more as this gateway relays "
        "more streams)",
    ),
    (
        "--replica-sync",
        str,
        "true",
        "share in-flight load, speculation and sessions with other gateway replicas via Redis",
    ),
    (
        "--grpc-mux",
        "bool",
        "true",
        "carry every request to a gRPC worker on its one GenerateMany stream (false: one "
        "Generate call per request)",
    ),
    (
        "--fast-bpe",
        "bool",
        "true",
        "tokenize with tiktoken's encoder where it gives exactly the tokenizer's ids (checked "
        "at start-up; 5x less CPU than HF tokenizers); false: HF tokenizers only",
    ),
    (
        "--worker-frames",
        "bool",
        "true",
        "carry that stream on a worker's frames port when it has one (plain TCP, no HTTP/2; "
        "never with --grpc-tls-ca or a gRPC token)",
    ),
    (
        "--processes",
        int,
        1,
        "processes serving the port, one per core to use (0 = one per usable core); the first "
        "holds the block index and the others ask it (the index is not copied)",
    ),
    ("--index-socket", str, "", "internal: a front process's link to its gateway's index owner"),
]


def _env_name(flag: str) -> str:
    return "KVROUTE_" + flag.lstrip("-").replace("-", "_").upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute gateway",
        description="OpenAI-compatible gateway that routes each request to the worker "
        "holding the longest cached prefix of it. Every flag falls back to "
        "the environment variable KVROUTE_<FLAG> (e.g. KVROUTE_REDIS_URL).",
    )
    for flag, _kind, default, text in _FLAGS:
        # Parsed as text so a bad value (flag or env) gets one ValueError naming the flag.
        env = os.environ.get(_env_name(flag))
        value = env if env is not None else default
        parser.add_argument(flag, default=value, help=f"{text} [env {_env_name(flag)}]")
    return parser


def parse_bool(raw: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) as a flag or environment value."""
    lowered = raw.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(raw)


def _convert(args: argparse.Namespace, flag: str, kind: Callable[[str], Any] | str) -> Any:
    raw = getattr(args, flag.lstrip("-").replace("-", "_"))
    if kind == "bool":
        try:
            return parse_bool(str(raw))
        except ValueError:
            raise ValueError(f"{flag}: expected true or false, got {raw!r}") from None
    if raw is None or kind is str or isinstance(kind, str):
        return raw
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{flag}: expected {kind.__name__}, got {raw!r}") from exc


def config_from_args(argv: list[str]) -> GatewayConfig:
    """Parses flags (and their environment fallbacks) into a validated ``GatewayConfig``."""
    args = build_parser().parse_args(argv)
    v = {flag: _convert(args, flag, kind) for flag, kind, _, _ in _FLAGS}
    if not v["--model"]:
        raise ValueError("--model is required (a model folder or the alias smollm2)")
    return GatewayConfig(
        model_dir=resolve_model_dir(v["--model"]),
        served_model_name=v["--served-model-name"],
        redis_url=with_password(v["--redis-url"], os.environ.get(PASSWORD_ENV)),
        redis_namespace=v["--redis-namespace"],
        host=v["--host"],
        port=v["--port"],
        router=RouterConfig(
            policy=v["--policy"],
            balance_factor=v["--balance-factor"],
            recompute_weight=v["--recompute-weight"],
            shared_fill_gain=v["--shared-fill-gain"],
        ),
        session_ttl_s=v["--session-ttl"],
        speculative_ttl_s=v["--speculative-ttl"],
        max_queue_per_worker=v["--max-queue-per-worker"],
        request_timeout_s=v["--request-timeout"],
        first_token_timeout_s=v["--first-token-timeout"],
        inter_token_timeout_s=v["--inter-token-timeout"],
        engine_stall_s=v["--engine-stall-s"],
        max_body_bytes=v["--max-body-bytes"],
        api_keys_file=Path(v["--api-keys-file"]) if v["--api-keys-file"] else None,
        tenant_salt_secret=v["--tenant-salt-secret"],
        client_idle_timeout_s=v["--client-idle-timeout"],
        client_body_timeout_s=v["--client-body-timeout"],
        grpc_tls_ca=Path(v["--grpc-tls-ca"]) if v["--grpc-tls-ca"] else None,
        grpc_token=_token(v["--grpc-token-file"]),
        log_level=v["--log-level"].lower(),
        access_log=v["--access-log"],
        vllm_metrics=v["--vllm-metrics"],
        index_max_entries=v["--index-max-entries"],
        redis_cluster=_flag_bool("--redis-cluster", v["--redis-cluster"]),
        replica_sync=_flag_bool("--replica-sync", v["--replica-sync"]),
        stream_interval=v["--stream-interval"],
        grpc_mux=v["--grpc-mux"],
        worker_frames=v["--worker-frames"],
        fast_bpe=v["--fast-bpe"],
        processes=v["--processes"] or usable_cores(),
        index_socket=v["--index-socket"],
    )


def _token(raw: str) -> str:
    """The shared token in ``--grpc-token-file``, read once; "" without the flag."""
    if not raw:
        return ""
    path = Path(raw).expanduser()
    try:
        return read_token_file(path)
    except ValueError as exc:
        raise ValueError(f"--grpc-token-file {path}: {exc}") from exc


def _flag_bool(flag: str, raw: str) -> bool:
    if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{flag}: expected true or false, got {raw!r}")
    return raw.lower() in ("true", "1", "yes")


async def serve(config: GatewayConfig, argv: list[str] | None = None) -> None:
    """Runs the gateway until SIGINT/SIGTERM (with ``--processes`` above 1, its front
    processes too, started with ``argv``, the flags this process was given)."""
    from gateway.edge.app import create_app
    from gateway.edge.app_keys import STATE
    from gateway.routing.index_share import RemoteIndex
    from openai_api.server_log import redact_parser_errors

    redact_parser_errors()  # aiohttp would log an over-long header's first 100 bytes
    socket_dir = None
    if config.processes > 1:  # this process owns the index; its socket lives here
        socket_dir = tempfile.mkdtemp(prefix="kvroute-gateway-")
        config = replace(
            config, index_socket=os.path.join(socket_dir, "index.sock"), index_owner=True
        )
    app = create_app(config)
    owner_lost = app[STATE].owner_lost
    # Cancelling a handler when its client disconnects aborts the worker request too.
    # keepalive_timeout runs from the connection's start (and from each response): a
    # client that sends nothing, or its headers a byte at a time, is closed by then.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=config.client_idle_timeout_s,
    )
    await runner.setup()
    # Tokenizer, chat template and index are loaded: keep them out of every later
    # collection, so a full GC pass never stalls the loop on start-up objects.
    gc.collect()
    gc.freeze()
    # Collections less often. A request leaves few cycles (refcounts free the rest),
    # but at CPython's default (700 new containers) the youngest generation was
    # collected every few requests, each time walking the live requests' token-id
    # lists, and a full pass (~33 ms) walked the prefix cache's ids: after start-up GC
    # took 1.06 of a gateway's 15.7 s of CPU on small, cold and repeated 6k chats
    # (bench_overhead, one round; timed with gc.callbacks), 0.10 s with these
    # thresholds (5 young collections, none older). Same-run A/Bs (the setting in a
    # patched worktree as the baseline router against the build before it): CPU a
    # small chat 0.83-0.94x, a repeated 6k chat 0.78-0.85x, a cold one 0.90-0.95x;
    # p99 at c=64 37 against 104 ms (small). RSS after 75 s of cold 6k chats 576
    # against 574 MB (loadtest.gateway_memory).
    gc.set_threshold(10_000, 20, 50)
    # Every process of a multi-process gateway listens on the one port.
    site = web.TCPSite(runner, config.host, config.port, reuse_port=bool(config.index_socket))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {config.port} on {config.host} is in use (another gateway, or a "
                "worker's HTTP front?): stop it or pick another with --port"
            ) from exc
        raise StartupError(f"cannot listen on {config.host}:{config.port}: {exc}") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pod = app[STATE].pod
    if isinstance(pod, RemoteIndex):
        pod.listening()
    fronts = None
    if config.processes > 1:
        port = runner.addresses[0][1]  # the one the OS gave, with --port 0
        fronts = FrontProcesses(argv or [], config.processes - 1, port, config.index_socket)
        fronts.start()
    logger.info(
        "kvroute gateway serving %s on %s (policy %s%s)",
        config.model_name,
        ", ".join(site.name for site in runner.sites),
        config.router.policy,
        f", {config.processes} processes" if config.processes > 1 else "",
    )
    try:
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, owner_lost)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
    finally:
        logger.info("shutting down")
        if fronts is not None:
            await fronts.stop()
        await runner.cleanup()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvroute gateway``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = config_from_args(argv)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"kvroute gateway: {exc}\n")
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not config.access_log:
        logging.getLogger("kvroute.access").setLevel(logging.WARNING)
    loop_factory = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        logger.warning("uvloop not installed; using the default event loop")
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config, argv))
    except StartupError as exc:
        sys.stderr.write(f"kvroute gateway: {exc}\n")
        return 1
    except (OSError, ValueError) as exc:
        # Unreadable or malformed files (tokenizer, chat template, keys, CA): one line, the
        # traceback only at --log-level debug.
        logger.debug("start-up failed", exc_info=True)
        sys.stderr.write(f"kvroute gateway: cannot start: {exc}\n")
        return 1
    return 0


class StartupError(RuntimeError):
    """A reason the gateway cannot start that fits one line (port in use, ...)."""


if __name__ == "__main__":
    raise SystemExit(main())
