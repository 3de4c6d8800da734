"""``kvroute gateway`` as an operator meets it: a busy port, a bad file or an unreachable
Redis is one line that says what to fix, never a traceback or silence."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadtest.fleet import free_port

ROOT = Path(__file__).resolve().parents[2]


def _gateway(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute_cli", "gateway", "--model", "smollm2", *args],
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("kvroute gateway:")]


def test_busy_port_is_one_line(smollm2: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _gateway("--host", "127.0.0.1", "--port", str(port))
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert _lines(out) == [
        f"kvroute gateway: port {port} on 127.0.0.1 is in use (another gateway, or a worker's "
        "HTTP front?): stop it or pick another with --port"
    ]
    assert "Traceback" not in out


def test_bad_keys_file_is_one_line(smollm2: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text("{not json")
    proc = _gateway("--port", str(free_port()), "--api-keys-file", str(keys))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    (line,) = _lines(out)
    assert f"--api-keys-file {keys}" in line and "Traceback" not in out
    proc = _gateway("--port", str(free_port()), "--grpc-tls-ca", str(tmp_path / "missing.pem"))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--grpc-tls-ca" in out and "Traceback" not in out


def test_unreachable_redis_is_logged_and_explained(smollm2: Path) -> None:
    dead = free_port()  # nothing listens there
    port = free_port()
    proc = _gateway(
        "--host", "127.0.0.1", "--port", str(port), "--redis-url", f"redis://127.0.0.1:{dead}/0"
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            assert resp.status == 200  # alive, even without Redis
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
            raise AssertionError("ready without ever reaching Redis")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("served without a worker")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            message = json.loads(exc.read())["error"]["message"]
        assert f"cannot reach Redis at redis://127.0.0.1:{dead}/0" in message
        time.sleep(6)  # long enough for a second "cannot reach" line
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    warnings = [line for line in out.splitlines() if "cannot reach redis" in line]
    assert 2 <= len(warnings) <= 4, out[-2000:]  # every few seconds, not every retry
    # The access log line of the 503, with the request id.
    assert any(
        "POST /v1/chat/completions 503 id=chatcmpl-" in line and "kvroute.access" in line
        for line in out.splitlines()
    ), out[-2000:]
