"""The worker's torch thread: the model is loaded on the thread that then steps it
(``worker.engine.torch_thread`` says why), and the engine behaves as on its own thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.worker.engine_harness import FakeRunner, Harness, expected, greedy
from worker.engine.torch_thread import TorchThread


async def test_run_returns_results_and_raises_errors_on_one_thread() -> None:
    thread = TorchThread(name="t-test")
    names = {await thread.run(lambda: threading.current_thread().name) for _ in range(3)}
    assert names == {"t-test"}
    assert await thread.run(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        await thread.run(lambda: 1 / 0)
    assert await thread.run(lambda: "still serving") == "still serving"
    thread.close()


async def test_the_engine_steps_on_the_thread_that_built_its_runner() -> None:
    thread = TorchThread(name="t-engine")
    built_on: list[str] = []
    stepped_on: set[str] = set()

    class RecordingRunner(FakeRunner):
        def __init__(self) -> None:
            built_on.append(threading.current_thread().name)
            super().__init__()

        def execute(self, chunks):  # type: ignore[no-untyped-def]
            stepped_on.add(threading.current_thread().name)
            return super().execute(chunks)

    runner = await thread.run(RecordingRunner)
    harness = Harness(runner)
    harness.engine.start(on=thread)
    try:
        tokens, out = await harness.run("r1", [5, 6, 7], greedy(6))
        assert tokens == expected([5, 6, 7], 6) and out.finish_reason == "length"
        assert harness.engine.health(stall_s=5.0) is None
    finally:
        harness.engine.shutdown()
    assert built_on == ["t-engine"] and stepped_on == {"t-engine"}
    assert harness.engine.health(stall_s=5.0) == "the engine thread is not running"
    # The loop has returned: the thread serves other work again.
    assert await asyncio.wait_for(thread.run(lambda: 42), 5) == 42
    thread.close()
