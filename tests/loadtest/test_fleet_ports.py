"""Fleet start-up survives a worker or gateway whose port was taken between
``free_port`` and its bind.

A real fleet (Redis, one emulated worker, the gateway): the first port handed to
the worker (or the gateway) is one this test holds open, as the fleet's own
outgoing connections can hold one on a busy host; the process dies on it and is
started again on a fresh port.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import fleet as fleet_module
from loadtest.fleet import Fleet, FleetConfig


def _one_emulated_worker(model: Path) -> FleetConfig:
    return FleetConfig(
        model=str(model),
        workers=1,
        worker_args=("--engine", "emulated", "--profile", "h100-llama3.1-8b"),
        startup_timeout=120.0,
    )


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A port something listens on, as another process can hold one."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_a_worker_whose_port_is_taken_starts_again(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    real = fleet_module.free_port
    calls = iter(range(1000))

    def free_port() -> int:
        # Call 0 is Redis's port; call 1 the worker's gRPC port: hand it the taken one.
        return int(taken.getsockname()[1]) if next(calls) == 1 else real()

    monkeypatch.setattr(fleet_module, "free_port", free_port)
    cfg = _one_emulated_worker(smollm2)
    with Fleet(cfg) as fleet:
        (worker,) = fleet.workers
        assert worker.port_retries == 1
        assert worker.grpc_port != taken.getsockname()[1]
        assert fleet.healthy_workers() == 1


def test_a_gateway_whose_port_is_taken_starts_again(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    real_free_port = fleet_module.free_port
    real_start = Fleet.start_gateway
    starts = []

    def start_gateway(self: Fleet) -> None:
        # The first start draws the taken port, as a race with another process would.
        first = not starts
        starts.append(1)
        if first:
            monkeypatch.setattr(fleet_module, "free_port", lambda: taken.getsockname()[1])
        try:
            real_start(self)
        finally:
            monkeypatch.setattr(fleet_module, "free_port", real_free_port)

    monkeypatch.setattr(Fleet, "start_gateway", start_gateway)
    cfg = _one_emulated_worker(smollm2)
    with Fleet(cfg) as fleet:
        assert len(starts) == 2 and fleet._gateway_port_retries == 1
        assert fleet.gateway_port != taken.getsockname()[1]
        assert fleet.healthy_workers() == 1
