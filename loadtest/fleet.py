"""A local fleet in one call: a private Redis, N worker processes and a gateway.

``Fleet`` starts one as a context manager (for ``kvroute up`` in
``loadtest.up``, the demo, benchmarks and integration tests); every child's
log can stream to the terminal with a ``name | `` prefix and goes to
``<log_dir>/<name>.log``. Every component is a real process talking real Redis, gRPC
and HTTP, bound to loopback by default; nothing is simulated. When a child
dies before it listens, the error quotes the last lines of its log.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from contract.redis_url import redact
from loadtest.child_logs import ChildLog, echo_target

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within it SIGTERM ends a benchmark as Ctrl-C does, so that its ``finally`` blocks
    stop the workers, gateways and Redis it started (killed by SIGTERM, a benchmark left
    them all running). Main thread only, as every signal handler."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


PORT_RETRIES = 3
# What a child's log says when a port ``free_port`` chose was taken before the child
# bound it: gRPC's and ZMQ's bind error (workers, vLLM), and the gateway's own check.
PORT_TAKEN = ("address already in use", "is in use")


def port_was_taken(log: ChildLog | None) -> bool:
    """Whether the (exited) child whose output ``log`` read died of a taken port."""
    if log is None:
        return False
    log.join()
    return any(log.saw(phrase) for phrase in PORT_TAKEN)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on ``host:port`` (or it cannot be bound)."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _wait_for_port(
    port: int,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: ChildLog | None = None,
) -> None:
    name = log.name if log is not None else "process"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            if log is not None:
                log.join()
            where = f" (log: {log.path})" if log is not None and log.path else ""
            said = f"; its last lines:\n{log.tail()}" if log is not None else ""
            raise RuntimeError(
                f"{name} exited with {proc.returncode} before listening on {port}{where}{said}"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{name}: nothing listened on 127.0.0.1:{port} within {timeout:.0f}s")


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
    log_dir: str = ""  # "" = no log files (the tail is still kept for errors)
    echo_logs: bool = False  # stream every child's log to stderr, prefixed with its name
    host: str = "127.0.0.1"  # what workers and the gateway bind
    startup_timeout: float = 180.0
    # Workers also serve the gateway's stream on a frames port (contract.frames), which
    # the gateway then uses; never with TLS or a token among ``worker_args``.
    worker_frames: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not 0 <= self.gateway_port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.gateway_port}")


@dataclass
class WorkerProcess:
    worker_id: str
    grpc_port: int
    http_port: int
    proc: subprocess.Popen[bytes]
    port_retries: int = 0  # starts again after its port was taken (``PORT_RETRIES`` at most)

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
    logs: dict[str, ChildLog] = field(default_factory=dict)
    _gateway_port_retries: int = 0
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

    def log_path(self, name: str) -> Path | None:
        """Where ``name``'s log is written, or None without ``log_dir``."""
        if not self.config.log_dir:
            return None
        Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
        return Path(self.config.log_dir) / f"{name}.log"

    def _popen(
        self,
        name: str,
        cmd: list[str],
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        logger.info("starting %s: %s", name, " ".join(redact(a) for a in cmd))
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )
        assert proc.stdout is not None
        self.logs[name] = ChildLog(
            name,
            proc.stdout,
            self.log_path(name),
            echo_target(self.config.echo_logs),
            watch=PORT_TAKEN,
        )
        return proc

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "kvroute_cli", *args]
        return self._popen(name, cmd, cwd=Path(__file__).resolve().parents[1], env=env)

    def worker_env(self) -> dict[str, str] | None:
        """Several workers on one host share its cores: their OpenMP threads must sleep,
        not spin, between parallel regions (libgomp spins while it manages no more threads
        than CPUs, which each worker alone does), or each steals the others' cores."""
        if self.config.workers < 2 or "OMP_WAIT_POLICY" in os.environ:
            return None
        return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server")
        self._tmp = Path(tempfile.mkdtemp(prefix="kvroute-fleet-"))
        port = free_port()
        self._redis = self._popen(
            "redis",
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
        )
        _wait_for_port(port, 10, self._redis, self.logs["redis"])
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def start_worker(self, index: int) -> WorkerProcess:
        worker = self._launch_worker(index)
        self.workers.append(worker)
        return worker

    def _launch_worker(self, index: int) -> WorkerProcess:
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
            "--host",
            cfg.host,
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
        secured = any(a.startswith(("--tls-cert", "--grpc-token-file")) for a in cfg.worker_args)
        if cfg.worker_frames and not secured:
            args += ["--frames-port", str(free_port())]
        proc = self._spawn(worker_id, args, self.worker_env())
        return WorkerProcess(worker_id, grpc_port, http_port, proc)

    def _relaunch_if_port_taken(self, slot: int) -> bool:
        """Starts the worker in ``slot`` again on fresh ports when it died because one of
        its ports was taken: ``free_port`` only finds a port free *now*, and the fleet's
        own outgoing connections (sixteen workers to Redis) draw from the same range."""
        worker = self.workers[slot]
        if worker.port_retries >= PORT_RETRIES:
            return False
        if not port_was_taken(self.logs.get(worker.worker_id)):
            return False
        logger.warning("%s: its port was taken as it started; starting it again", worker.worker_id)
        fresh = self._launch_worker(int(worker.worker_id.rsplit("-", 1)[1]))
        fresh.port_retries = worker.port_retries + 1
        self.workers[slot] = fresh
        return True

    def _wait_worker_listens(self, slot: int, deadline: float) -> None:
        while True:
            worker = self.workers[slot]
            try:
                _wait_for_port(
                    worker.grpc_port,
                    max(1.0, deadline - time.monotonic()),
                    worker.proc,
                    self.logs.get(worker.worker_id),
                )
                return
            except RuntimeError:
                if not self._relaunch_if_port_taken(slot):
                    raise

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
            cfg.host,
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
        for slot in range(len(self.workers)):
            self._wait_worker_listens(slot, deadline)
        self._wait_gateway_listens(deadline)
        assert self.gateway is not None
        want = len(self.workers) if expected_workers is None else expected_workers
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                if self._relaunch_gateway_if_port_taken():
                    self._wait_gateway_listens(deadline)
                    continue
                self.logs["gateway"].join()
                raise RuntimeError(
                    f"gateway exited with {self.gateway.returncode}; its last lines:\n"
                    f"{self.logs['gateway'].tail()}"
                )
            # A worker can die after its port answered (another process held that port):
            # fail now with its log instead of waiting out the start-up timeout.
            for slot, worker in enumerate(self.workers):
                if worker.proc.poll() is not None:
                    if self._relaunch_if_port_taken(slot):
                        self._wait_worker_listens(slot, deadline)
                        continue
                    log = self.logs.get(worker.worker_id)
                    if log is not None:
                        log.join()
                    raise RuntimeError(
                        f"{worker.worker_id} exited with {worker.proc.returncode}; its last lines:\n"
                        f"{log.tail() if log is not None else ''}"
                    )
            if self.healthy_workers() >= want:
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"the gateway saw {self.healthy_workers()} of {want} workers healthy within "
            f"{cfg.startup_timeout:.0f}s; its last lines:\n{self.logs['gateway'].tail()}"
        )

    def _wait_gateway_listens(self, deadline: float) -> None:
        while True:
            assert self.gateway is not None
            try:
                _wait_for_port(
                    self.gateway_port,
                    max(1.0, deadline - time.monotonic()),
                    self.gateway,
                    self.logs.get("gateway"),
                )
                return
            except RuntimeError:
                if not self._relaunch_gateway_if_port_taken():
                    raise

    def _relaunch_gateway_if_port_taken(self) -> bool:
        """Starts the gateway again on a fresh port when the one ``free_port`` chose was
        taken before it bound it (as ``_relaunch_if_port_taken`` does for a worker)."""
        if self.config.gateway_port or self._gateway_port_retries >= PORT_RETRIES:
            return False
        if not port_was_taken(self.logs.get("gateway")):
            return False
        logger.warning("gateway: its port was taken as it started; starting it again")
        self._gateway_port_retries += 1
        self.start_gateway()
        return True

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

        cfg = self.config
        # Checked first, so a busy port is one line, not a traceback after the workers load.
        if cfg.gateway_port and port_in_use(cfg.host, cfg.gateway_port):
            raise RuntimeError(
                f"port {cfg.gateway_port} on {cfg.host} is in use: stop what holds it "
                "or pick another with --port"
            )
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

    def named_processes(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """Every child this fleet started, by log name."""
        out = [(w.worker_id, w.proc) for w in self.workers]
        if self.gateway is not None:
            out.append(("gateway", self.gateway))
        if self._redis is not None:
            out.append(("redis", self._redis))
        return out

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [proc for _, proc in self.named_processes()]

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
        for log in self.logs.values():
            log.join(1.0)
