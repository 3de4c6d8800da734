"""One thread for a worker's torch work: the model load, then the engine loop.

Why one: torch's CPU parallelism is libgomp (OpenMP), which keeps a pool of
worker threads for every thread that has run a parallel region, and once it
manages more threads than the host has CPUs it stops spinning between
regions and parks its workers on a futex. A decode step is ~600 short
parallel regions, so each one then pays a wake-up. Loading SmolLM2 on an
``asyncio.to_thread`` thread and stepping on the engine thread left three
OpenMP threads on a 2-core host: a batch-8 decode step took 76 ms instead of
52 (and 0.69x vLLM's tokens/s over HTTP). Loading on the thread that then
runs the loop keeps the process at one pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


class TorchThread:
    """A daemon thread running jobs in order: ``run`` one from asyncio, ``submit`` a loop.

    Daemon (not a ``ThreadPoolExecutor``, whose threads the interpreter joins at
    exit): an engine loop still waiting for commands must never hold up an exit.
    """

    def __init__(self, name: str = "kvroute-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the thread, awaited."""
        return await asyncio.wrap_future(self.submit(lambda: fn(*args, **kwargs)))

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queues ``fn``; a long-running loop holds the thread until it returns."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        """Lets the thread exit after the jobs already queued; does not wait."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
