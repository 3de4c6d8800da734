"""The emulated runner: its time model is exact arithmetic, its tokens are deterministic,
and the real Engine (block pool, scheduler, prefix hits) runs on it without torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.hashing import HashSpec
from worker.engine.batch import SeqChunk
from worker.engine.sequence import SamplingParams
from worker.engine.thread import Engine, EngineConfig
from worker.model.emulated import (
    PROFILES_DIR,
    EmulatedRunner,
    EmulatedSampler,
    Profile,
    TimeModel,
    load_profile,
)
from worker.serve.config import config_from_args

MODEL = TimeModel(
    step_s=1.0,
    prefill_token_s=0.1,
    prefill_pair_s=0.001,
    decode_seq_s=0.01,
    decode_context_s=0.0001,
    logits_row_s=0.5,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 5000, "eos_token_id": 2}))
    return tmp_path


def test_step_time_is_the_documented_sum() -> None:
    prefill = SeqChunk(list(range(10)), 4, [0, 1, 2, 3], need_logits=False)
    decode = SeqChunk([7], 20, [4, 5, 6], need_logits=True)
    # prefill: 10 tokens, pairs 10 * (4 + 11/2) = 95; decode: one seq of context 21; one row
    expected = 1.0 + 0.1 * 10 + 0.001 * 95 + 0.01 + 0.0001 * 21 + 0.5
    assert MODEL.step_time([prefill, decode]) == pytest.approx(expected)
    assert MODEL.step_time([]) == 0.0
    assert MODEL.prefill_time(10, 4) == pytest.approx(1.0 + 1.0 + 0.095 + 0.5)
    assert MODEL.decode_time(2, 21) == pytest.approx(1.0 + 2 * 0.51 + 2 * 0.0021)


def test_runner_sleeps_the_model_and_tokens_are_deterministic(model_dir: Path) -> None:
    slept: list[float] = []
    profile = Profile("t", MODEL, kv_capacity_tokens=64, max_model_len=64)
    runner = EmulatedRunner(profile, model_dir, block_size=4, sleep=slept.append)
    assert runner.num_blocks == 16 and runner.vocab_size == 5000 and runner.eos_token_ids == (2,)
    chunk = SeqChunk([5, 6, 7], 0, [0], need_logits=True)
    first = runner.execute([chunk])
    assert first == runner.execute([chunk]) and len(first) == 1
    assert first[0] in runner.output_token_ids and first[0] != 2
    assert slept[0] == pytest.approx(MODEL.step_time([chunk]), rel=0.01)
    with pytest.raises(ValueError, match="block table"):
        runner.execute([SeqChunk([1] * 8, 0, [0], need_logits=True)])


def test_checked_in_profiles_load() -> None:
    names = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
    assert "h100-llama3.1-8b" in names
    for name in names:
        profile = load_profile(name)
        assert profile.sources, f"{name} must cite its sources"
        assert profile.time_model.step_time([SeqChunk([1], 9, [0], need_logits=True)]) > 0
    with pytest.raises(ValueError, match="--profile"):
        load_profile("no-such-profile")


def test_worker_flags() -> None:
    cfg = config_from_args(["--model", "m", "--engine", "emulated", "--profile", "x"], env={})
    assert (cfg.engine, cfg.profile, cfg.emulated_time_scale) == ("emulated", "x", 1.0)
    with pytest.raises(ValueError, match="--profile is required"):
        config_from_args(["--model", "m", "--engine", "emulated"], env={})
    with pytest.raises(ValueError, match="--engine"):
        config_from_args(["--model", "m", "--engine", "tpu"], env={})


async def test_engine_on_the_emulated_runner_hits_the_prefix_cache(model_dir: Path) -> None:
    profile = Profile("t", TimeModel(step_s=0.001), kv_capacity_tokens=256, max_model_len=128)
    runner = EmulatedRunner(profile, model_dir, block_size=4)
    engine = Engine(
        runner,
        EngineConfig(max_num_seqs=4, max_batch_tokens=64),
        hash_spec=HashSpec(block_size=4, model="m"),
        sampler=EmulatedSampler(),
    )
    engine.start()
    try:
        params = SamplingParams(max_tokens=5, temperature=0.7, seed=3)
        prompt = list(range(100, 120))
        runs = []
        for rid in ("a", "b"):
            outs = [o async for o in engine.generate(rid, prompt, params)]
            runs.append(([t for o in outs for t in o.new_token_ids], outs[-1].cached_tokens))
    finally:
        engine.shutdown()
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 5
    assert (runs[0][1], runs[1][1]) == (0, 20)  # all 5 full blocks of the prompt
