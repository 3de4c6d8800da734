"""One real worker process and one real gateway in front of it (gRPC between them).

Shared by the end-to-end option and tool tests: ``serve_pair`` starts both on
free ports in their own Redis namespace and yields once the gateway sees the
worker.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI

from tests.gateway.helpers import namespace
from tests.gateway.test_fleet import Proc, _spawn
from tests.support import free_port, wait_for_port, wait_until


@dataclass
class Pair:
    model_dir: Path
    name: str
    gateway: Proc
    worker: Proc

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.gateway.port}/v1", api_key="x")

    def worker_client(self) -> OpenAI:
        port = self.worker.extra["http_port"]
        return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")


@contextmanager
def serve_pair(model: Path, redis_url: str, logs: Path, *, frames: bool = False) -> Iterator[Pair]:
    """A worker (256 blocks) and a gateway on ``model``; both stopped on exit.

    With ``frames`` the worker also serves a frames port, which the gateway then uses.
    """
    ns = namespace()
    grpc_port, http_port, gw_port = free_port(), free_port(), free_port()
    frames_args = ["--frames-port", str(free_port())] if frames else []
    common = ["--model", str(model), "--redis-url", redis_url, "--redis-namespace", ns]
    worker = _spawn(
        "w0",
        ["worker", *common, "--worker-id", "w0", "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--num-blocks", "256", "--heartbeat-interval", "0.3",
         "--heartbeat-ttl", "1.5", "--log-level", "WARNING", *frames_args],
        logs,
        grpc_port,
    )  # fmt: skip
    worker.extra["http_port"] = http_port
    gateway = _spawn(
        "gateway",
        ["gateway", *common, "--port", str(gw_port), "--host", "127.0.0.1",
         "--log-level", "warning"],
        logs,
        gw_port,
    )  # fmt: skip
    try:
        for port in (grpc_port, http_port, gw_port):
            wait_for_port(port, timeout=120)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/readyz", timeout=5) as r:
                    return json.loads(r.read()).get("healthy_workers") == 1
            except OSError:
                return False

        wait_until(ready, timeout=60, what="the gateway sees the worker")
        yield Pair(model, model.resolve().name, gateway, worker)
    finally:
        for p in (gateway, worker):
            p.stop(signal.SIGTERM)
