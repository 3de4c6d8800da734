"""A vLLM server whose port was taken between ``free_port`` and its bind starts again.

vLLM binds its KV-event sockets about 20 s after it starts, so on a busy host
another process can take one of the ports first; the server then dies with
ZMQ's "Address already in use", a few dozen lines before its log ends. Here a
stand-in for the api_server (a plain Python process that binds the same three
ports and answers ``/health``, or dies as vLLM does) replaces the real one,
which takes minutes to start; ``tests/vllm`` runs the real one.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

from loadtest import vllm_fleet
from loadtest.fleet import FleetConfig
from loadtest.vllm_fleet import VllmFleet, VllmServer

STAND_IN = r"""
import http.server, socket, sys
port, events, replay, exit_code = (int(a) for a in sys.argv[1:])
if exit_code:
    print("RuntimeError: Engine core initialization failed", flush=True)
    sys.exit(exit_code)
held = []
for p in (events, replay):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        print(f"zmq.error.ZMQError: Address already in use (addr='tcp://*:{p}')", flush=True)
        for n in range(40):  # the cause scrolls out of the last lines, as in vLLM's log
            print(f"shutting down {n}", flush=True)
        sys.exit(1)
    held.append(s)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process holds."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield int(sock.getsockname()[1])
    sock.close()


def stand_in(monkeypatch: pytest.MonkeyPatch, exit_code: int = 0) -> None:
    monkeypatch.setattr(vllm_fleet, "vllm_python", lambda: sys.executable)

    def args(model_dir: str, port: int, events: int, replay: int, *_: object) -> list[str]:
        return ["-c", STAND_IN, str(port), str(events), str(replay), str(exit_code)]

    monkeypatch.setattr(vllm_fleet, "vllm_args", args)


def fleet_with(server: VllmServer) -> VllmFleet:
    fleet = VllmFleet(FleetConfig(workers=1, startup_timeout=30.0))
    fleet.servers.append(server)
    server.start()
    return fleet


def test_a_server_whose_replay_port_was_taken_starts_again_on_fresh_ports(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    stand_in(monkeypatch)
    fleet = fleet_with(VllmServer("vllm-0", "model", replay_port=taken))
    try:
        server = fleet._wait_healthy(0)
        assert server is fleet.servers[0]
        assert server.replay_port != taken
        assert server.healthy()
        assert "vllm-0" in fleet.startup_s
    finally:
        for server in fleet.servers:
            server.stop()


def test_a_server_that_dies_for_another_reason_is_not_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_in(monkeypatch, exit_code=3)
    first = VllmServer("vllm-0", "model")
    fleet = fleet_with(first)
    try:
        with pytest.raises(RuntimeError, match="Engine core initialization failed"):
            fleet._wait_healthy(0)
        assert fleet.servers[0] is first
    finally:
        first.stop()
