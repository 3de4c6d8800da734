"""Engine end to end (fake runner, real Sampler): how a request's outputs are streamed.

Closing, cancelling and aborting a stream, a slow reader getting what piled
up as one output, tokens ready before a failure coming out before the error,
``merge_outputs``, and ``--stream-interval``. The harness is
``tests.worker.engine_harness``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.worker.engine_harness import (
    SPEC,
    FakeRunner,
    Harness,
    SteppedRunner,
    after_steps,
    assert_refcounts_zero,
    expected,
    greedy,
    make_fixture,  # noqa: F401 (the make fixture)
)
from worker.engine.output_stream import merge_outputs
from worker.engine.thread import Engine, EngineConfig, RequestOutput
from worker.model.sampler import Sampler


async def test_close_cancel_and_abort_free_everything(make: Callable[..., Harness]) -> None:
    runner = SteppedRunner()  # one step at first, so the request is surely mid-stream
    runner.gate = threading.Event()
    h = make(runner)
    runner.gate.set()
    gen = h.engine.generate("closed", [1, 2, 3, 4, 5], greedy(30))
    pending = asyncio.ensure_future(gen.__anext__())
    runner.release()
    first = await asyncio.wait_for(pending, 5)
    assert first.new_token_ids == expected([1, 2, 3, 4, 5], 1)
    await gen.aclose()
    runner.release(1000)  # from here on the gate alone holds the steps

    runner.gate.clear()  # hold the engine mid-step so both requests are surely in flight
    task = asyncio.create_task(h.collect("cancelled", [9] * 9, greedy(30)))
    aborted = asyncio.create_task(h.collect("aborted", [9] * 9, greedy(30)))
    await asyncio.sleep(0.05)
    task.cancel()
    assert h.engine.abort("aborted") is True
    assert h.engine.abort("unknown") is False
    runner.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    outs = await asyncio.wait_for(aborted, 10)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    stats = await h.idle_stats()
    assert stats.requests_total == 3
    assert_refcounts_zero(h)


async def test_a_slow_reader_gets_what_piled_up_as_one_output(
    make: Callable[..., Harness],
) -> None:
    runner = SteppedRunner()
    h = make(runner)
    prompt = [3, 4, 5]
    gen = h.engine.generate("slow", prompt, greedy(6))
    first = asyncio.ensure_future(gen.__anext__())
    runner.release()
    out = await asyncio.wait_for(first, 5)
    assert len(out.new_token_ids) == 1 and not out.finished  # the first token is not held
    runner.release(4)
    await after_steps(runner, 5)
    out = await asyncio.wait_for(gen.__anext__(), 5)  # four steps' tokens, one output
    assert len(out.new_token_ids) == 4 and not out.finished
    runner.release()
    last = await asyncio.wait_for(gen.__anext__(), 5)
    assert last.finished and last.new_token_ids == expected(prompt, 6)[5:]
    assert (last.completion_tokens, last.prompt_tokens, last.finish_reason) == (6, 3, "length")
    await gen.aclose()


async def test_tokens_before_a_failure_come_out_then_the_error(
    make: Callable[..., Harness],
) -> None:
    runner = SteppedRunner()
    h = make(runner)
    gen = h.engine.generate("fails", [3, 4, 5], greedy(8))
    first = asyncio.ensure_future(gen.__anext__())
    runner.release()
    assert (await asyncio.wait_for(first, 5)).new_token_ids == expected([3, 4, 5], 1)
    runner.release(2)
    await after_steps(runner, 3)
    runner.fail_next = True
    runner.release()
    await asyncio.sleep(0.1)
    out = await asyncio.wait_for(gen.__anext__(), 5)  # the two tokens ready before the failure
    assert out.new_token_ids == expected([3, 4, 5], 3)[1:]
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(gen.__anext__(), 5)
    assert_refcounts_zero(h)


def test_merge_outputs_keeps_order_and_the_last_outputs_finish() -> None:
    def out(tokens: list[int], **kw: Any) -> RequestOutput:
        fields: dict[str, Any] = {
            "request_id": "r",
            "finished": False,
            "finish_reason": None,
            "prompt_tokens": 7,
            "cached_tokens": 4,
            "completion_tokens": 0,
            "ttft_s": 0.5,
        }
        fields.update(kw)
        return RequestOutput(
            new_token_ids=tokens, new_logprobs=[f"lp{t}" for t in tokens], **fields
        )

    merged = merge_outputs(
        [
            out([1], completion_tokens=1),
            out([2, 3], completion_tokens=3),
            out([4], completion_tokens=4, finished=True, finish_reason="stop"),
        ]
    )
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert merged.new_logprobs == ["lp1", "lp2", "lp3", "lp4"]
    assert (merged.finished, merged.finish_reason, merged.completion_tokens) == (True, "stop", 4)
    assert (merged.prompt_tokens, merged.cached_tokens, merged.ttft_s) == (7, 4, 0.5)


async def test_stream_interval_holds_tokens_but_not_the_first_or_last(
    make: Callable[..., Harness],
) -> None:
    runner = SteppedRunner()
    h = make(runner, stream_interval=3)
    prompt = [3, 4, 5]
    gen = h.engine.generate("every3", prompt, greedy(8))
    first = asyncio.ensure_future(gen.__anext__())
    runner.release()
    assert len((await asyncio.wait_for(first, 5)).new_token_ids) == 1  # TTFT is not held
    pending = asyncio.ensure_future(gen.__anext__())
    runner.release(2)
    await after_steps(runner, 3)
    assert not pending.done()  # two tokens ready, three wanted
    runner.release()
    out = await asyncio.wait_for(pending, 5)
    assert len(out.new_token_ids) == 3 and not out.finished
    runner.release(4)  # tokens 5..8; the eighth ends the request and goes out at once
    rest = [o async for o in gen]
    assert rest[-1].finished
    assert all(len(o.new_token_ids) >= 3 for o in rest[:-1])
    assert [t for o in rest for t in o.new_token_ids] == expected(prompt, 8)[4:]
    with pytest.raises(ValueError, match="--stream-interval"):
        Engine(FakeRunner(), EngineConfig(), hash_spec=SPEC, sampler=Sampler(), stream_interval=0)
