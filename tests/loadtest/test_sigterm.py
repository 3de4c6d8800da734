"""A benchmark killed with SIGTERM stops what it started, as Ctrl-C makes it do."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.fleet import sigterm_as_ctrl_c

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for a benchmark: a child process it must stop in a ``finally`` block.
_BENCH = """
import subprocess, sys, time
from loadtest.fleet import sigterm_as_ctrl_c
child = subprocess.Popen(["sleep", "60"])
try:
    with sigterm_as_ctrl_c():
        # Only now, with the handler in place: a SIGTERM sent as soon as the pid was
        # read once came before the handler on a loaded CI host and killed the
        # benchmark outright, leaving the child alive.
        print(child.pid, flush=True)
        time.sleep(60)
finally:
    child.kill()
    child.wait()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_runs_the_benchmarks_finally_blocks() -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", _BENCH], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert bench.stdout is not None
    child = int(bench.stdout.readline())
    assert _alive(child)
    try:
        bench.send_signal(signal.SIGTERM)
        bench.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)  # without the handler it outlives the benchmark
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_previous_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_ctrl_c():
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    ("module", "inner", "argv"),
    [
        ("loadtest.bench_engine", "run", []),
        ("loadtest.bench_fp8_kv", "_measure", []),
        ("loadtest.bench_grpc_shapes", "run", []),
        ("loadtest.bench_scale", "run", ["--fleets", "10x100"]),
        ("loadtest.clients_smoke", "smoke", []),
    ],
)
def test_benchmarks_that_start_processes_measure_under_the_handler(
    module: str, inner: str, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Killed by SIGTERM without it, bench_engine --against vllm left its kvroute worker
    # running (December 2026): each of these starts servers or workers in ``inner``.
    mod = importlib.import_module(module)
    seen = []

    def record(*_args: object, **_kwargs: object) -> dict[str, object]:
        seen.append(signal.getsignal(signal.SIGTERM))
        return {}

    monkeypatch.setattr(mod, inner, record)
    if module == "loadtest.clients_smoke":
        monkeypatch.setattr(mod, "assemble", lambda results, command: results)
    assert mod.main(argv) == 0
    assert seen == [signal.default_int_handler]
    assert signal.getsignal(signal.SIGTERM) is not signal.default_int_handler
