"""Engine end to end (fake runner, real Sampler): prefix caching, scheduling and the engine's API.

Cold and cached requests match the reference, chunked prefill and preemption,
evictions announced as events, stop tokens, seeded sampling, pinned prefixes,
cache salts, ``reset_prefix_cache``, a failing step, and input checks. The
harness is ``tests.worker.engine_harness``; streaming is ``test_engine_streaming``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from contract.events import AllBlocksCleared, BlockRemoved
from contract.hashing import HashSpec, block_hashes
from tests.worker.engine_harness import (
    BS,
    SPEC,
    VOCAB,
    FakeRunner,
    Harness,
    assert_refcounts_zero,
    expected,
    greedy,
    make_fixture,  # noqa: F401 (the make fixture)
)
from worker.engine.sequence import SamplingParams
from worker.engine.thread import Engine, EngineConfig
from worker.model.sampler import Sampler


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
