"""``kvroute up``: a local fleet (private Redis, N workers, the gateway) in the foreground.

Streams every child's log with a ``name | `` prefix, writes each to
``<--log-dir>/<name>.log``, binds loopback unless ``--host`` says otherwise,
and stops everything on Ctrl-C or SIGTERM, or when any child exits.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time

from contract.redis_url import redact
from loadtest.fleet import Fleet, FleetConfig

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="kvroute up",
        description="A local fleet: Redis, N workers and the gateway. Flags fall back to KVROUTE_<FLAG>.",
    )
    parser.add_argument(
        "--model",
        default=env("KVROUTE_MODEL", "smollm2"),
        help="model folder, .gguf file or the alias smollm2 (default) [env KVROUTE_MODEL]",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--policy", default="kvroute", help="gateway routing policy")
    parser.add_argument(
        "--host",
        default=env("KVROUTE_HOST", "127.0.0.1"),
        help="address the gateway and workers bind (default 127.0.0.1) [env KVROUTE_HOST]",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(env("KVROUTE_PORT", "8000")),
        help="gateway port (default 8000) [env KVROUTE_PORT]",
    )
    parser.add_argument(
        "--redis-url",
        default=env("KVROUTE_REDIS_URL", ""),
        help="use this Redis instead of starting a private one [env KVROUTE_REDIS_URL]",
    )
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    parser.add_argument(
        "--log-dir",
        default=env("KVROUTE_LOG_DIR", ".kvroute-logs"),
        help="each process's log goes to <dir>/<name>.log (default .kvroute-logs) "
        "[env KVROUTE_LOG_DIR]",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="do not stream the children's logs to the terminal"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvroute up``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvroute up: %(message)s")
    try:
        config = FleetConfig(
            model=args.model,
            workers=args.workers,
            policy=args.policy,
            gateway_port=args.port,
            redis_url=args.redis_url,
            num_blocks=args.num_blocks,
            log_dir=args.log_dir,
            echo_logs=not args.quiet,
            host=args.host,
        )
    except ValueError as exc:
        sys.stderr.write(f"kvroute up: {exc}\n")
        return 2
    # SIGTERM ends the fleet as cleanly as Ctrl-C does (children get SIGTERM too), and is a
    # normal stop (exit 0) wherever it lands, even while the "fleet up" line is written.
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with Fleet(config) as fleet, contextlib.suppress(KeyboardInterrupt):
            logger.info(
                "fleet up: gateway %s (dashboard %s/dashboard), %d workers, redis %s, logs in %s/",
                fleet.gateway_url,
                fleet.gateway_url,
                len(fleet.workers),
                redact(fleet.redis_url),
                config.log_dir,
            )
            while all(p.poll() is None for p in fleet.processes()):
                time.sleep(0.5)
            for name, proc in fleet.named_processes():
                if proc.poll() is not None:
                    logger.error("%s exited with %s; stopping the fleet", name, proc.returncode)
                    return 1
    except (RuntimeError, TimeoutError, OSError) as exc:
        sys.stderr.write(f"kvroute up: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 0 if terminated else 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
