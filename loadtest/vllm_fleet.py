"""A local fleet of real vLLM CPU servers, each joined by a ``kvroute bridge``, and a gateway.

``VllmFleet`` is ``loadtest.fleet.Fleet`` with vLLM in the workers' place: a
private Redis, N ``vllm.entrypoints.openai.api_server`` processes (from
``.venv-vllm``, built by ``.ci/vllm-venv.sh`` when missing), one bridge per
server, and the kvroute gateway. Used by ``tests/vllm`` and by
``python -m loadtest.bench_fleet --engine vllm``.

vLLM's arguments are fixed (``vllm_args``). By default servers run with
``--enforce-eager``: vLLM 0.32's CPU build recompiles its model on every start
(its AOT artifact fails to load back), 40-240 s depending on the machine's
load, while eager mode starts in well under a minute. Each server gets its own
CPU (``VLLM_CPU_OMP_THREADS_BIND``) when there are enough.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from contract.model_paths import served_model_name
from loadtest.child_logs import ChildLog, echo_target
from loadtest.fleet import (
    PORT_RETRIES,
    PORT_TAKEN,
    Fleet,
    FleetConfig,
    WorkerProcess,
    free_port,
    port_was_taken,
    sigterm_as_ctrl_c,
)

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_BLOCK_SIZE = 32  # vLLM on CPU takes multiples of 32 only
VLLM_MAX_MODEL_LEN = 2048

logger = logging.getLogger(__name__)


def vllm_python() -> Path:
    """``.venv-vllm/bin/python``, building the venv first if it is not there."""
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".vllm-stamp").exists():
        subprocess.run(["bash", str(ROOT / ".ci" / "vllm-venv.sh")], check=True)
    return python


def vllm_cpu_env(kv_space_gib: int, cpus: str) -> dict[str, str]:
    """The environment of a vLLM CPU server here: offline, ``kv_space_gib`` of KV cache,
    its OpenMP threads bound to ``cpus`` (``"0-1"``)."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        VLLM_CPU_OMP_THREADS_BIND=cpus,
    )


STRUCTURED_OUTPUTS = '{"backend":"guidance","disable_any_whitespace":true}'


def vllm_args(
    model_dir: str,
    port: int,
    events_port: int,
    replay_port: int,
    num_blocks: int,
    eager: bool = True,
) -> list[str]:
    """The api_server arguments every kvroute fleet uses (kept fixed for the compile cache)."""
    events = (
        '{"enable_kv_cache_events":true,"publisher":"zmq",'
        f'"endpoint":"tcp://*:{events_port}","replay_endpoint":"tcp://*:{replay_port}",'
        '"topic":"kv"}'
    )
    args = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_model_name(model_dir),
        "--dtype",
        "float32",
        "--block-size",
        str(VLLM_BLOCK_SIZE),
        "--max-model-len",
        str(VLLM_MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-events-config",
        events,
        # The gateway's tool-call constraints are llguidance Lark grammars, and kvroute's
        # own workers constrain JSON to compact whitespace: without this a small model
        # spends a forced call's tokens on newlines (finish_reason "length").
        "--structured-outputs-config",
        STRUCTURED_OUTPUTS,
    ]
    if num_blocks:
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    if eager:
        # vLLM 0.32 on CPU cannot load its own AOT artifact back ("'function' object has no
        # attribute 'finalize_loading'") and recompiles on every start; eager mode skips it.
        args.append("--enforce-eager")
    return args


@dataclass
class VllmServer:
    """One vLLM api_server (its own process group, so its EngineCore goes with it)."""

    name: str
    model_dir: str
    num_blocks: int = 0
    eager: bool = True
    cpus: str = ""
    log_path: Path | None = None
    echo: bool = False
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log: ChildLog | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self) -> None:
        env = vllm_cpu_env(1, self.cpus or f"0-{max(0, (os.cpu_count() or 1) - 1)}")
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        args = vllm_args(
            self.model_dir,
            self.port,
            self.events_port,
            self.replay_port,
            self.num_blocks,
            self.eager,
        )
        self.proc = subprocess.Popen(
            [str(vllm_python()), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.log = ChildLog(
            self.name,
            self.proc.stdout,
            self.log_path,
            echo_target(self.echo),
            watch=PORT_TAKEN,
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until ``/health`` answered; raises with the log's tail if it never does."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.tail() if self.log else ''}")
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(
            f"{self.name} not healthy in {timeout:.0f}s: {self.log and self.log.tail()}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Stops the server's whole process group (SIGKILL when ``sig`` is, or on timeout)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # EngineCore may outlive its parent for a moment; the group goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.log is not None:
            self.log.join(1.0)
        self.proc = None


@dataclass
class VllmFleet(Fleet):
    """``Fleet`` whose workers are vLLM servers behind bridges (``workers[i].http_url`` is vLLM)."""

    num_blocks: int = 0  # per server; 0 = what 1 GiB of KV space holds
    eager: bool = True  # --enforce-eager (no torch.compile: starts in a fraction of the time)
    servers: list[VllmServer] = field(default_factory=list)
    bridges: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    startup_s: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        from worker.model.store import resolve_model

        self.model_dir = str(resolve_model(self.config.model))
        cpus = os.cpu_count() or 1
        try:
            if self.config.redis_url:
                self.redis_url = self.config.redis_url
            else:
                self.start_redis()
            for i in range(self.config.workers):
                server = VllmServer(
                    f"vllm-{i}",
                    self.model_dir,
                    num_blocks=self.num_blocks,
                    eager=self.eager,
                    cpus=str(i % cpus) if self.config.workers <= cpus else "",
                    log_path=self.log_path(f"vllm-{i}"),
                    echo=self.config.echo_logs,
                )
                server.start()
                self.servers.append(server)
            for slot in range(len(self.servers)):
                server = self._wait_healthy(slot)
                self.start_bridge(server)
            self.start_gateway()
            self.wait_serving(len(self.servers))
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, slot: int) -> VllmServer:
        """Waits for the server in ``slot``; starts it again on fresh ports when one of them
        was taken as it started: ``free_port`` only finds a port free *now*, and vLLM binds
        its ZMQ sockets some 20 s later, while the other servers open connections."""
        retries = 0
        while True:
            server = self.servers[slot]
            try:
                self.startup_s[server.name] = server.wait_healthy(self.config.startup_timeout)
                return server
            except RuntimeError:
                if retries >= PORT_RETRIES or not port_was_taken(server.log):
                    raise
            retries += 1
            logger.warning("%s: a port was taken as it started; starting it again", server.name)
            server.stop()
            fresh = replace(
                server, port=free_port(), events_port=free_port(), replay_port=free_port()
            )
            fresh.start()
            self.servers[slot] = fresh

    def start_bridge(
        self, server: VllmServer, *, namespace: str = "", name: str = ""
    ) -> subprocess.Popen[bytes]:
        """A ``kvroute bridge`` for ``server`` (into ``namespace``, default the fleet's)."""
        worker_id = name or server.name
        cfg = self.config
        proc = self._spawn(
            f"bridge-{worker_id}",
            [
                "bridge",
                "--engine",
                "vllm",
                "--events",
                server.events,
                "--replay",
                server.replay,
                "--topic",
                "kv",
                "--url",
                server.url,
                "--redis-url",
                self.redis_url,
                "--redis-namespace",
                namespace or cfg.namespace,
                "--worker-id",
                worker_id,
                "--tokenizer",
                self.model_dir,
                "--heartbeat-interval",
                str(cfg.heartbeat_interval),
                "--heartbeat-ttl",
                str(cfg.heartbeat_ttl),
            ],
        )
        self.bridges[f"{namespace}:{worker_id}" if namespace else worker_id] = proc
        if not namespace:
            self.workers.append(WorkerProcess(worker_id, 0, server.port, proc))
        return proc

    def wait_serving(self, want: int) -> None:
        """Until the gateway listens and routes to ``want`` workers."""
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            if self.gateway is not None and self.gateway.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.logs['gateway'].tail()}")
            if self.healthy_workers() >= want:
                return
            time.sleep(0.2)
        raise TimeoutError(f"gateway saw {self.healthy_workers()} of {want} vLLM workers")

    def stop(self) -> None:
        for proc in self.bridges.values():  # first, so they deregister while Redis is up
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.bridges.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.workers.clear()  # their procs are the bridges, already stopped
        for server in self.servers:
            server.stop()
        super().stop()


def _main() -> int:
    """``python -m loadtest.vllm_fleet``: starts a 2-worker fleet and prints its URLs."""
    fleet = VllmFleet(FleetConfig(workers=2, echo_logs=True))
    with sigterm_as_ctrl_c(), fleet:
        print(fleet.gateway_url, [s.url for s in fleet.servers], fleet.startup_s, file=sys.stderr)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
