"""A local fleet in one call: a private Redis, N worker processes and a gateway.

``kvroute up`` runs one in the foreground until Ctrl-C; ``Fleet`` is the same
thing as a context manager for the demo, benchmarks and integration tests.
Every component is a real process talking real Redis, gRPC and HTTP on
loopback ports; nothing is simulated.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from contract.redis_url import redact

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout}s")


@dataclass(frozen=True)
class FleetConfig:
    """What to start. ``redis_url`` empty = start a private redis-server."""

    model: str = "smollm2"
    workers: int = 2
    policy: str = "kvroute"
    gateway_port: int = 0
    redis_url: str = ""
    namespace: str = "kvroute"
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 16
    max_batch_tokens: int = 2048
    heartbeat_interval: float = 0.5
    heartbeat_ttl: float = 2.0
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: str = ""
    startup_timeout: float = 180.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")


@dataclass
class WorkerProcess:
    worker_id: str
    grpc_port: int
    http_port: int
    proc: subprocess.Popen[bytes]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass
class Fleet:
    """Starts everything in ``start()``; ``stop()`` (or leaving the ``with``) ends it all."""

    config: FleetConfig
    redis_url: str = ""
    gateway_port: int = 0
    workers: list[WorkerProcess] = field(default_factory=list)
    gateway: subprocess.Popen[bytes] | None = None
    model_dir: str = ""
    _redis: subprocess.Popen[bytes] | None = None
    _tmp: Path | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log(self, name: str) -> int | None:
        if not self.config.log_dir:
            return subprocess.DEVNULL  # type: ignore[return-value]
        Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
        return os.open(
            Path(self.config.log_dir) / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out = self._log(name)
        cmd = [sys.executable, "-m", "kvroute_cli", *args]
        logger.info("starting %s: %s", name, " ".join(redact(a) for a in cmd))
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1]
        )
        if isinstance(out, int) and out != subprocess.DEVNULL:
            os.close(out)
        return proc

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server")
        self._tmp = Path(tempfile.mkdtemp(prefix="kvroute-fleet-"))
        port = free_port()
        self._redis = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._tmp),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for_port(port, 10, self._redis)
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def start_worker(self, index: int) -> WorkerProcess:
        cfg = self.config
        worker_id = f"worker-{index}"
        grpc_port, http_port = free_port(), free_port()
        args = [
            "worker",
            "--model",
            self.model_dir,
            "--redis-url",
            self.redis_url,
            "--redis-namespace",
            cfg.namespace,
            "--worker-id",
            worker_id,
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--block-size",
            str(cfg.block_size),
            "--num-blocks",
            str(cfg.num_blocks),
            "--max-num-seqs",
            str(cfg.max_num_seqs),
            "--max-batch-tokens",
            str(cfg.max_batch_tokens),
            "--heartbeat-interval",
            str(cfg.heartbeat_interval),
            "--heartbeat-ttl",
            str(cfg.heartbeat_ttl),
            *cfg.worker_args,
        ]
        worker = WorkerProcess(worker_id, grpc_port, http_port, self._spawn(worker_id, args))
        self.workers.append(worker)
        return worker

    def start_gateway(self) -> None:
        cfg = self.config
        self.gateway_port = cfg.gateway_port or free_port()
        args = [
            "gateway",
            "--model",
            self.model_dir,
            "--redis-url",
            self.redis_url,
            "--redis-namespace",
            cfg.namespace,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.gateway_port),
            "--policy",
            cfg.policy,
            *cfg.gateway_args,
        ]
        self.gateway = self._spawn("gateway", args)

    def wait_ready(self, expected_workers: int | None = None) -> None:
        """Blocks until every worker listens and the gateway sees all of them."""
        cfg = self.config
        deadline = time.monotonic() + cfg.startup_timeout
        for worker in self.workers:
            _wait_for_port(worker.grpc_port, max(1.0, deadline - time.monotonic()), worker.proc)
        assert self.gateway is not None
        _wait_for_port(self.gateway_port, max(1.0, deadline - time.monotonic()), self.gateway)
        want = len(self.workers) if expected_workers is None else expected_workers
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.gateway.returncode}")
            if self.healthy_workers() >= want:
                return
            time.sleep(0.2)
        raise TimeoutError(f"gateway did not see {want} healthy workers in time")

    def healthy_workers(self) -> int:
        """How many workers the gateway routes to now (from its /readyz body)."""
        import json

        try:
            with urllib.request.urlopen(f"{self.gateway_url}/readyz", timeout=2) as resp:
                return int(json.loads(resp.read()).get("healthy_workers", 0))
        except (urllib.error.URLError, OSError, ValueError):
            return 0

    def start(self) -> None:
        from worker.model.store import resolve_model

        # Resolve (and for a GGUF, convert) once here, so workers do not race to
        # convert and the gateway reads the very folder the workers load.
        self.model_dir = str(resolve_model(self.config.model))
        try:
            if self.config.redis_url:
                self.redis_url = self.config.redis_url
            else:
                self.start_redis()
            for i in range(self.config.workers):
                self.start_worker(i)
            self.start_gateway()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def kill_worker(self, index: int) -> None:
        """SIGKILL one worker (fault tests): no deregistration, its key must expire."""
        self.workers[index].proc.kill()
        self.workers[index].proc.wait(timeout=10)

    def stop(self) -> None:
        procs = [w.proc for w in self.workers]
        if self.gateway is not None:
            procs.insert(0, self.gateway)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._redis is not None:
            self._redis.terminate()
            self._redis.wait(timeout=10)
            self._redis = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute up", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("KVROUTE_MODEL", "smollm2"),
        help="model folder, .gguf file or the alias smollm2 (default)",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--policy", default="kvroute", help="gateway routing policy")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL", ""),
        help="use this Redis instead of starting a private one",
    )
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    parser.add_argument("--log-dir", default="", help="write each process's log here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = FleetConfig(
        model=args.model,
        workers=args.workers,
        policy=args.policy,
        gateway_port=args.port,
        redis_url=args.redis_url,
        num_blocks=args.num_blocks,
        log_dir=args.log_dir,
    )
    # SIGTERM ends the fleet as cleanly as Ctrl-C does (children get SIGTERM too).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with Fleet(config) as fleet:
        logger.info(
            "fleet up: gateway %s, %d workers, redis %s",
            fleet.gateway_url,
            len(fleet.workers),
            fleet.redis_url,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while all(w.proc.poll() is None for w in fleet.workers):
                time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
