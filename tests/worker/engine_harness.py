"""The engine test harness: a fake model runner, the real Sampler, and the ``make`` fixture.

The fake runner keeps a toy KV cache (slot -> (position, token)) and derives
each next token from the whole context it reads back through the block
table, so a wrong prefix hit, a stale block or a bad block table changes the
output. ``expected`` is the same function applied to the true token list.
``SteppedRunner`` lets a test release the engine one step at a time. Test
modules take the fixture with ``from tests.worker.engine_harness import make_fixture``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from contract.hashing import HashSpec
from worker.engine.batch import SeqChunk
from worker.engine.sequence import RequestTimings, SamplingParams
from worker.engine.thread import (
    Engine,
    EngineConfig,
    EngineStats,
    RequestOutput,
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


@pytest.fixture(name="make")
async def make_fixture() -> AsyncIterator[Callable[..., Harness]]:
    """``make(runner=None, stream_interval=1, **config)``: a started ``Harness``; all shut down after."""
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


async def after_steps(runner: FakeRunner, steps: int) -> None:
    """Waits until ``runner`` ran ``steps`` steps and their outputs reached the loop."""
    for _ in range(500):
        if len(runner.steps) >= steps:
            break
        await asyncio.sleep(0.01)
    assert len(runner.steps) >= steps
    await asyncio.sleep(0.05)  # the engine thread's call_soon_threadsafe deliveries
