"""Engine end to end with a fake model runner and the real Sampler.

The fake runner keeps a toy KV cache (slot -> (position, token)) and derives
each next token from the whole context it reads back through the block
table, so a wrong prefix hit, a stale block or a bad block table changes the
output. ``expected`` is the same function applied to the true token list.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from contract.hashing import HashSpec, block_hashes
from worker.engine.batch import SeqChunk
from worker.engine.sequence import RequestTimings, SamplingParams
from worker.engine.thread import (
    Engine,
    EngineConfig,
    EngineStats,
    RequestOutput,
    merge_outputs,
)
from worker.model.sampler import Sampler

BS = 4
VOCAB = 50
EOS = 0
SPEC = HashSpec(block_size=BS, model="fake")


def next_token(context: list[int]) -> int:
    """The fake model: depends on every token and position, never EOS by itself."""
    mix = sum((i + 1) * t for i, t in enumerate(context))
    return 1 + (mix * 31 + len(context)) % (VOCAB - 1)


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    """A deterministic stand-in for ModelRunner that checks the SeqChunk contract."""

    def __init__(self, num_blocks: int = 12, eos: tuple[int, ...] = (EOS,)) -> None:
        self.num_blocks = num_blocks
        self.block_size = BS
        self.vocab_size = VOCAB
        self.max_model_len = 256
        self.eos_token_ids = eos
        self.model_name = "fake"
        self.kv: dict[int, tuple[int, int]] = {}
        self.steps: list[list[SeqChunk]] = []
        self.fail_next = False
        self.gate: threading.Event | None = None  # when set, each step waits for it

    def _slot(self, chunk: SeqChunk, pos: int) -> int:
        return chunk.block_table[pos // BS] * BS + pos % BS

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        self.steps.append(chunks)
        rows = []
        for chunk in chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            assert len(chunk.block_table) == -(-end // BS), "block table must cover exactly"
            for i, token in enumerate(chunk.token_ids):
                self.kv[self._slot(chunk, chunk.start_pos + i)] = (chunk.start_pos + i, token)
            if chunk.need_logits:
                context = []
                for pos in range(end):
                    stored_pos, token = self.kv[self._slot(chunk, pos)]
                    assert stored_pos == pos, "KV slot holds another position"
                    context.append(token)
                row = torch.zeros(VOCAB)
                row[next_token(context)] = 2.0  # peaked, but sampling at T=1 still varies
                rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


class SteppedRunner(FakeRunner):
    """A FakeRunner whose every step waits for one ``release``: the test sets the pace."""

    def __init__(self) -> None:
        super().__init__()
        self._allowed = threading.Semaphore(0)

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._allowed.release()

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        assert self._allowed.acquire(timeout=5), "the test never released this step"
        return super().execute(chunks)


class Harness:
    def __init__(self, runner: FakeRunner, stream_interval: int = 1, **config: Any) -> None:
        self.runner = runner
        self.events: list[KVEvent] = []
        self.finished: list[tuple[RequestOutput, RequestTimings]] = []
        self.engine = Engine(
            runner,
            EngineConfig(**config),
            hash_spec=SPEC,
            on_events=self.events.extend,
            on_request_finished=lambda out, t: self.finished.append((out, t)),
            sampler=Sampler(),
            stream_interval=stream_interval,
        )

    async def run(
        self, rid: str, prompt: list[int], params: SamplingParams, **kw: Any
    ) -> tuple[list[int], RequestOutput]:
        outs = await asyncio.wait_for(self.collect(rid, prompt, params, **kw), 10)
        assert outs[-1].finished
        return [t for out in outs for t in out.new_token_ids], outs[-1]

    async def collect(
        self, rid: str, prompt: list[int], params: SamplingParams, **kw: Any
    ) -> list[RequestOutput]:
        return [out async for out in self.engine.generate(rid, prompt, params, **kw)]

    def index(self) -> set[int]:
        """The block set a gateway would hold after applying every event in order."""
        held: set[int] = set()
        for event in self.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
        return held

    async def idle_stats(self) -> EngineStats:
        for _ in range(200):
            stats = self.engine.stats()
            if stats.running == 0 and stats.waiting == 0:
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError("engine did not go idle")


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Harness]]:
    made: list[Harness] = []
    made_stepped: list[SteppedRunner] = []

    def factory(runner: FakeRunner | None = None, **config: Any) -> Harness:
        if isinstance(runner, SteppedRunner):
            made_stepped.append(runner)
        h = Harness(runner or FakeRunner(), **config)
        h.engine.start()
        made.append(h)
        return h

    yield factory
    for runner in made_stepped:
        runner.release(1000)  # let shutdown's last step through
    for h in made:
        if h.runner.gate is not None:
            h.runner.gate.set()
        h.engine.shutdown()


def assert_refcounts_zero(h: Harness, pinned: int = 0) -> None:
    stats = h.engine.stats()
    assert stats.used_blocks == pinned and stats.free_blocks == stats.num_blocks - pinned
    assert h.engine.resident_block_hashes() == h.index()


async def test_cold_then_prefix_hit_match_the_reference(make: Callable[..., Harness]) -> None:
    h = make()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    tokens, out = await h.run("a", prompt, greedy(6))
    assert tokens == expected(prompt, 6)
    assert (out.finish_reason, out.prompt_tokens, out.cached_tokens) == ("length", 10, 0)
    assert out.completion_tokens == 6 and out.ttft_s is not None and out.ttft_s > 0
    second = [*prompt[:8], 30, 31, 32]
    tokens, out = await h.run("b", second, greedy(5))
    assert tokens == expected(second, 5)
    assert out.cached_tokens == 8
    whole, out = await h.run("c", prompt[:8], greedy(3))
    assert whole == expected(prompt[:8], 3) and out.cached_tokens == 8
    stats = await h.idle_stats()
    assert (stats.prompt_tokens_total, stats.cached_prompt_tokens_total) == (29, 16)
    assert stats.generation_tokens_total == 14 and stats.requests_total == 3
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert_refcounts_zero(h)
    timings = h.finished[0][1]
    assert len(timings.inter_token_latencies_s) == 5 and timings.ttft_s is not None
    assert timings.queue_s is not None and timings.e2e_s >= timings.ttft_s


async def test_concurrent_chunked_and_preempted_requests_match(
    make: Callable[..., Harness],
) -> None:
    h = make(FakeRunner(num_blocks=10), max_batch_tokens=5, max_num_seqs=4)
    prompts = [[1 + i, *range(10, 10 + 3 * i)] for i in range(6)]  # lengths 1..16
    results = await asyncio.gather(*(h.run(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)))
    for prompt, (tokens, out) in zip(prompts, results, strict=True):
        assert tokens == expected(prompt, 8)
        assert out.finish_reason == "length"
    stats = await h.idle_stats()
    assert stats.preemptions_total > 0  # 10 blocks cannot hold four growing sequences
    assert any(not c.need_logits for s in h.runner.steps for c in s)  # split prompts
    assert max(sum(len(c.token_ids) for c in s) for s in h.runner.steps) == 5
    assert_refcounts_zero(h)


async def test_evictions_are_announced_and_index_tracks_pool(make: Callable[..., Harness]) -> None:
    h = make(FakeRunner(num_blocks=6))
    for i in range(4):
        prompt = [i + 1] * 12  # 3 full blocks each: later ones evict earlier ones
        tokens, _ = await h.run(f"e{i}", prompt, greedy(1))
        assert tokens == expected(prompt, 1)
    stats = await h.idle_stats()
    assert stats.evictions_total > 0
    assert any(isinstance(e, BlockRemoved) for e in h.events)
    assert h.engine.resident_block_hashes() == h.index()
    assert set(block_hashes([4] * 12, SPEC)) <= h.index()


async def test_stop_tokens_eos_and_ignore_eos(make: Callable[..., Harness]) -> None:
    prompt = [3, 4, 5]
    ref = expected(prompt, 6)
    h = make(FakeRunner(eos=(ref[2],)))
    tokens, out = await h.run("eos", prompt, greedy(6))
    assert tokens == ref[:3] and out.finish_reason == "stop"
    tokens, out = await h.run("ign", prompt, greedy(6, ignore_eos=True))
    assert tokens == ref and out.finish_reason == "length"
    tokens, out = await h.run("stop", prompt, greedy(6, ignore_eos=True, stop_token_ids=(ref[4],)))
    assert tokens == ref[:5] and out.finish_reason == "stop"


async def test_seeded_sampling_is_reproducible(make: Callable[..., Harness]) -> None:
    h = make()
    prompt = [7, 8, 9]
    runs = [
        (await h.run(f"s{i}", prompt, SamplingParams(max_tokens=12, seed=seed)))[0]
        for i, seed in enumerate((1, 1, 2))
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


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


async def test_pinned_prefix_survives_pressure(make: Callable[..., Harness]) -> None:
    h = make(FakeRunner(num_blocks=6))
    system = [40, 41, 42, 43, 44, 45, 46, 47, 48]  # 2 full blocks
    pinned = await asyncio.to_thread(h.engine.pin_prefix, system)
    assert pinned == 2
    pinned_hashes = set(block_hashes(system, SPEC))
    for i in range(3):
        await h.run(f"p{i}", [i + 1] * 12, greedy(2))  # needs 3-4 of the 4 unpinned blocks
    assert pinned_hashes <= h.engine.resident_block_hashes()
    tokens, out = await h.run("user", [*system[:8], 1, 2], greedy(3))
    assert tokens == expected([*system[:8], 1, 2], 3) and out.cached_tokens == 8
    stats = await h.idle_stats()
    assert stats.pinned_blocks == 2 and stats.requests_total == 4
    assert_refcounts_zero(h, pinned=2)


async def test_cache_salt_isolates_tenants(make: Callable[..., Harness]) -> None:
    h = make()
    prompt = list(range(1, 10))
    _, out = await h.run("t1", prompt, greedy(1), cache_salt="tenant-a")
    _, out = await h.run("t2", prompt, greedy(1), cache_salt="tenant-b")
    assert out.cached_tokens == 0
    _, out = await h.run("t3", prompt, greedy(1), cache_salt="tenant-a")
    assert out.cached_tokens == 8
    _, out = await h.run("t4", prompt, greedy(1), lora="adapter")
    assert out.cached_tokens == 0


async def test_reset_prefix_cache_clears_and_announces(make: Callable[..., Harness]) -> None:
    h = make()
    await h.run("r", list(range(1, 10)), greedy(1))
    assert h.engine.resident_block_hashes()
    assert await asyncio.to_thread(h.engine.reset_prefix_cache) is True  # /reset_prefix_cache
    assert h.events[-1] == AllBlocksCleared()
    assert h.engine.resident_block_hashes() == set() == h.index()


async def test_runner_failure_fails_only_that_step(make: Callable[..., Harness]) -> None:
    h = make()
    h.runner.fail_next = True
    with pytest.raises(RuntimeError, match="boom"):
        await h.run("bad", [1, 2, 3], greedy(2))
    tokens, _ = await h.run("good", [1, 2, 3], greedy(2))
    assert tokens == expected([1, 2, 3], 2)
    assert_refcounts_zero(h)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], greedy(1), "at least one token"),
        ([1, VOCAB], greedy(1), "outside the vocabulary"),
        ([1, -1], greedy(1), "outside the vocabulary"),
        ([1] * 250, greedy(10), "max_model_len"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], greedy(1, stop_token_ids=(VOCAB,)), "stop_token_ids"),
    ],
)
async def test_bad_input_is_a_value_error(
    make: Callable[..., Harness], prompt: list[int], params: SamplingParams, match: str
) -> None:
    h = make()
    with pytest.raises(ValueError, match=match):
        await h.run("x", prompt, params)
    assert h.engine.stats().waiting == 0


async def test_duplicate_request_id_and_config_checks(make: Callable[..., Harness]) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    h = make(runner)
    gen = h.engine.generate("dup", [1, 2], greedy(3))
    pending = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.02)
    with pytest.raises(ValueError, match="already in flight"):
        await h.run("dup", [1, 2], greedy(3))
    runner.gate.set()
    await pending
    await gen.aclose()
    assert h.engine.max_model_len == 12 * BS  # capped by the pool
    with pytest.raises(ValueError, match="--block-size"):
        Engine(FakeRunner(), EngineConfig(), hash_spec=HashSpec(block_size=8), sampler=Sampler())
    with pytest.raises(ValueError, match="--max-model-len"):
        Engine(FakeRunner(), EngineConfig(max_model_len=1000), hash_spec=SPEC, sampler=Sampler())
    with pytest.raises(ValueError, match="--max-batch-tokens"):
        EngineConfig(max_batch_tokens=0)


async def _after_steps(runner: FakeRunner, steps: int) -> None:
    """Waits until ``runner`` ran ``steps`` steps and their outputs reached the loop."""
    for _ in range(500):
        if len(runner.steps) >= steps:
            break
        await asyncio.sleep(0.01)
    assert len(runner.steps) >= steps
    await asyncio.sleep(0.05)  # the engine thread's call_soon_threadsafe deliveries


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
    await _after_steps(runner, 5)
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
    await _after_steps(runner, 3)
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
    await _after_steps(runner, 3)
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
