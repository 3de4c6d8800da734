"""``kvroute up`` as a user runs it: streamed, prefixed child logs, named log files, one-line errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from loadtest.fleet import Fleet, FleetConfig, WorkerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _up(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute_cli", "up", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_busy_port_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _up("--port", str(port), "--log-dir", str(tmp_path))
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"kvroute up: port {port} on 127.0.0.1 is in use" in out
    assert "Traceback" not in out


def test_missing_model_is_one_line(tmp_path: Path) -> None:
    proc = _up("--model", str(tmp_path / "nope"), "--port", "0", "--log-dir", str(tmp_path))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "not a model folder" in out
    assert "Traceback" not in out


def test_worker_that_dies_early_is_quoted(tiny_llama: Path, tmp_path: Path) -> None:
    config = FleetConfig(
        model=str(tiny_llama),
        workers=1,
        worker_args=("--max-num-seqs", "0"),
        log_dir=str(tmp_path),
        startup_timeout=120,
    )
    with pytest.raises(RuntimeError) as err:
        Fleet(config).start()
    message = str(err.value)
    assert "worker-0 exited with 2 before listening" in message
    assert "--max-num-seqs 0: must be positive" in message  # the worker's own words
    assert str(tmp_path / "worker-0.log") in message
    assert "--max-num-seqs 0" in (tmp_path / "worker-0.log").read_text()


def test_up_streams_prefixed_logs_and_writes_them(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = _up("--model", str(tiny_llama), "--workers", "1", "--num-blocks", "64",
               "--port", str(port), "--log-dir", str(tmp_path))  # fmt: skip
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "fleet up:" in line:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not up.wait(0.5) and proc.poll() is None and time.monotonic() < deadline:
            continue
        assert up.is_set(), "".join(lines[-40:])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    for name in ("redis", "worker-0", "gateway"):
        assert any(line.startswith(f"{name:<9} | ") for line in lines), name
        assert (tmp_path / f"{name}.log").stat().st_size > 0, name
    assert "kvroute gateway serving" in (tmp_path / "gateway.log").read_text()
    assert f"logs in {tmp_path}/" in out


def test_wait_ready_fails_fast_when_a_worker_dies_after_its_port_answered() -> None:
    """Another process held the worker's port, so the port answered; the worker then died
    (its HTTP bind failed). ``wait_ready`` must say so, not wait out the start-up timeout."""
    holders = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    worker_port, gateway_port = (h.getsockname()[1] for h in holders)
    dying = subprocess.Popen(["sleep", "1"])
    gateway = subprocess.Popen(["sleep", "60"])
    try:
        fleet = Fleet(FleetConfig(model="unused", startup_timeout=60))
        fleet.workers = [WorkerProcess("worker-0", worker_port, 0, dying)]
        fleet.gateway, fleet.gateway_port = gateway, gateway_port
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="worker-0 exited"):
            fleet.wait_ready()
        assert time.monotonic() - t0 < 20
    finally:
        gateway.kill()
        dying.kill()
        for h in holders:
            h.close()
