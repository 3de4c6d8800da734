"""The extra processes of ``kvroute gateway --processes N``, started and kept running.

The first process (the one the user started) binds the port with
``SO_REUSEPORT``, owns the block index and serves it on a unix socket
(``gateway.routing.index_share``); it then starts N-1 front processes with the
same flags plus ``--index-socket``, on the port it got. The kernel spreads
new connections over every process listening on the port. A front that exits
is started again after ``RESTART_S``; on shutdown each gets SIGTERM (it
finishes what it serves, as the owner does) and SIGKILL after ``STOP_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

RESTART_S = 1.0
STOP_S = 15.0
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "quota period", or "max period"


def usable_cores(cpu_max: Path = CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a
    Kubernetes CPU limit), rounded up; what ``--processes 0`` starts."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit to read: the affinity decides
    return cores


class FrontProcesses:
    """Runs ``count`` front processes of this gateway until ``stop``."""

    def __init__(self, argv: list[str], count: int, port: int, index_socket: str) -> None:
        # argparse takes a flag's last value: these override the user's.
        self.argv = [
            sys.executable,
            "-m",
            "gateway.cli",
            *argv,
            "--processes",
            "1",
            "--port",
            str(port),
            "--index-socket",
            index_socket,
        ]
        self.count = count
        self.procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(i)) for i in range(self.count)]

    async def _keep(self, i: int) -> None:
        while not self._stopping:
            proc = await asyncio.create_subprocess_exec(*self.argv)
            self.procs[i] = proc
            if self._stopping:  # stop() began while this one started
                proc.send_signal(signal.SIGTERM)
            code = await proc.wait()
            if self._stopping:
                return
            logger.error("gateway front process %d exited with %s; restarting it", i + 1, code)
            await asyncio.sleep(RESTART_S)

    async def stop(self) -> None:
        self._stopping = True
        live = [p for p in self.procs if p is not None and p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), STOP_S)
        except TimeoutError:
            for p in live:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await asyncio.gather(*(p.wait() for p in live))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
