"""``kvroute bridge``: joins a vLLM (or SGLang) worker to a kvroute fleet.

Every flag ``--foo-bar`` falls back to the environment variable
``KVROUTE_FOO_BAR`` (so a Helm sidecar sets everything through env), then to
the ``BridgeConfig`` default. Bad values exit with status 2 and a message that
names the flag; a tokenizer that disagrees with kvroute's exits with status 3.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from contract.redis_layout import RedisLayout
from contract.redis_url import PASSWORD_ENV, redact, with_password
from worker.bridge.bridge import Bridge, BridgeConfig
from worker.bridge.engine_events import ENGINES

logger = logging.getLogger(__name__)

_ENV_PREFIX = "KVROUTE_"
_SCHEMES = {
    "--events": ("tcp://", "ipc://"),
    "--replay": ("tcp://", "ipc://"),
    "--url": ("http://", "https://"),
    "--advertise-url": ("http://", "https://"),
    "--redis-url": ("redis://", "rediss://", "unix://"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute bridge",
        description="Announces an engine worker (vLLM) in kvroute's Redis registry from the "
        "engine's own ZMQ KV events. Every flag --foo-bar also reads env KVROUTE_FOO_BAR.",
    )
    add = p.add_argument
    add("--engine", choices=ENGINES, help="the engine's event dialect [default vllm]")
    add("--events", help="the engine's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557")
    add("--replay", help="the engine's replay endpoint, e.g. tcp://127.0.0.1:5558 [none]")
    add("--topic", help="the KV-event topic the engine publishes [all topics]")
    add("--url", help="the engine's HTTP API, e.g. http://127.0.0.1:8000")
    add("--advertise-url", help="the URL gateways use to reach the engine [--url]")
    add("--redis-url", help="Redis [redis://127.0.0.1:6379/0]")
    add("--redis-namespace", help="key prefix shared with the gateways [kvroute]")
    add("--worker-id", help="the worker's registry id [ENGINE-HOST-PORT of --url]")
    add("--model-name", help="the model name kvroute hashes with [the engine's served name]")
    add("--tokenizer", help="kvroute's tokenizer folder (or 'smollm2') for the agreement check")
    add("--block-size", type=int, help="override the engine's block size [from /metrics]")
    add("--heartbeat-interval", type=float, help="seconds between registry heartbeats [1.0]")
    add("--heartbeat-ttl", type=float, help="registry key TTL in seconds [3.0]")
    add("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="[INFO]")
    return p


def _env(flag: str) -> str:
    return _ENV_PREFIX + flag[2:].upper().replace("-", "_")


def config_from_args(
    argv: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[BridgeConfig, str]:
    """(config, log level) from flags with env fallback; raises ``ValueError`` naming a flag."""
    env = os.environ if env is None else env
    parser = build_parser()
    args = vars(parser.parse_args(list(argv)))
    values: dict[str, object] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        raw = args[action.dest]
        if raw is None and env.get(_env(flag)):
            text = env[_env(flag)]
            try:
                raw = action.type(text) if callable(action.type) else text
            except ValueError as exc:
                raise ValueError(f"{flag} {text!r}: {exc}") from exc
        if raw is None:
            continue
        schemes = _SCHEMES.get(flag)
        if schemes and not str(raw).startswith(schemes):
            raise ValueError(f"{flag} {raw!r}: must start with one of {', '.join(schemes)}")
        values[action.dest] = raw
    for flag in ("--events", "--url"):
        if flag[2:] not in values:
            raise ValueError(f"{flag} is required")
    level = str(values.pop("log_level", "INFO"))
    namespace = str(values.pop("redis_namespace", "kvroute"))
    RedisLayout(namespace)  # validates
    values["namespace"] = namespace
    redis_url = str(values.get("redis_url", "redis://127.0.0.1:6379/0"))
    if env.get(PASSWORD_ENV):
        redis_url = with_password(redis_url, env[PASSWORD_ENV])
    values["redis_url"] = redis_url
    for name in ("block_size",):
        if name in values and int(values[name]) <= 0:  # type: ignore[call-overload]
            raise ValueError(f"--block-size {values[name]!r}: must be positive")
    for name in ("heartbeat_interval", "heartbeat_ttl"):
        if name in values and not float(values[name]) > 0:  # type: ignore[arg-type]
            raise ValueError(f"--{name.replace('_', '-')} {values[name]!r}: must be positive")
    config = BridgeConfig(**values)  # type: ignore[arg-type]
    if config.heartbeat_ttl <= config.heartbeat_interval:
        raise ValueError("--heartbeat-ttl must be longer than --heartbeat-interval")
    return config, level


async def _serve(config: BridgeConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            logger.debug("cannot install a handler for %s", sig)
    return await Bridge(config).run(stop)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute bridge [flags]``; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config, level = config_from_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        logger.error("kvroute bridge: %s", exc)
        return 2
    logging.getLogger().setLevel(level)
    logger.info(
        "bridging %s at %s (events %s) into %s",
        config.engine,
        config.url,
        config.events,
        redact(config.redis_url),
    )
    return asyncio.run(_serve(config))
