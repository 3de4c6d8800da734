"""Small async helpers shared by the gateway tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.routing.mirror import IndexMirror


async def eventually(
    predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition"
) -> Any:
    """Polls ``predicate`` on the loop until truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


def namespace() -> str:
    """A fresh Redis namespace, so tests sharing one Redis never see each other."""
    return "t" + uuid.uuid4().hex[:12]


@contextlib.asynccontextmanager
async def running(mirror: IndexMirror) -> AsyncIterator[IndexMirror]:
    """``mirror.run()`` as a background task for the duration of the block."""
    task = asyncio.create_task(mirror.run())
    try:
        yield mirror
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
