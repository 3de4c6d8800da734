"""The real Engine + ModelRunner + Sampler against Hugging Face ``generate`` (greedy, fp32).

Cold prompts, prefix hits, and a batch of concurrent mixed-length requests
under a small token budget (so prompts are split into chunks and share steps
with decodes) must all produce exactly the tokens HF produces.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from contract.hashing import HashSpec
from worker.engine.sequence import SamplingParams
from worker.engine.thread import Engine, EngineConfig, RequestOutput
from worker.model.runner import ModelRunner

# loadtest/gpu_check.sh runs this module with KVROUTE_TEST_DEVICE=cuda.
DEVICE = os.environ.get("KVROUTE_TEST_DEVICE", "cpu")

TEXT = (
    "The quick brown fox jumps over the lazy dog while the patient cat watches from the "
    "warm windowsill, counting birds and clouds and the slow hours of a long summer afternoon "
    "in a small village by the sea, where fishermen mend their nets and children run along "
    "the harbour wall shouting at the gulls."
)


def tokenize(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF ``generate`` without EOS stopping, so both sides produce exactly ``n`` tokens."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


async def run(
    engine: Engine, rid: str, prompt: list[int], n: int
) -> tuple[list[int], RequestOutput]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = [o async for o in engine.generate(rid, prompt, params)]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


EngineFactory = Callable[..., Engine]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    engines: list[Engine] = []

    def factory(model_dir: Path, *, block_size: int, max_batch_tokens: int) -> Engine:
        runner = ModelRunner(model_dir, device=DEVICE, block_size=block_size, num_blocks=64)
        engine = Engine(
            runner,
            EngineConfig(max_batch_tokens=max_batch_tokens),
            hash_spec=HashSpec(block_size=block_size, model=runner.model_name),
        )
        engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()


async def test_tiny_model_matches_hf_cold_prefix_hit_and_chunked_batch(
    tiny_model: Path, make_engine: EngineFactory
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = make_engine(tiny_model, block_size=8, max_batch_tokens=16)
    ids = tokenize(tiny_model, TEXT)
    assert len(ids) > 48

    cold = ids[:21]
    tokens, out = await run(engine, "cold", cold, 8)
    assert tokens == hf_greedy(hf, cold, 8)
    assert out.cached_tokens == 0

    # Shares 2 full blocks (16 tokens) with the cold prompt, then diverges.
    hit = [*ids[:16], *ids[30:40]]
    tokens, out = await run(engine, "hit", hit, 8)
    assert tokens == hf_greedy(hf, hit, 8)
    assert out.cached_tokens == 16

    # Every block cached: only the last token is recomputed (into the shared block).
    whole = ids[:16]
    tokens, out = await run(engine, "whole", whole, 8)
    assert tokens == hf_greedy(hf, whole, 8)
    assert out.cached_tokens == 16

    prompts = [ids[40:45], ids[3:16], ids[:30], ids[5:46]]
    results = await asyncio.wait_for(
        asyncio.gather(*(run(engine, f"b{i}", p, 6) for i, p in enumerate(prompts))), 60
    )
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(hf, prompt, 6)
    assert results[2][1].cached_tokens == 16  # ids[:30] reuses the cold prompt's blocks
    stats = engine.stats()
    assert stats.used_blocks == 0 and stats.running == 0


async def test_smollm2_long_shared_prefix_is_a_hit_with_identical_output(
    smollm2: Path, make_engine: EngineFactory
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    engine = make_engine(smollm2, block_size=16, max_batch_tokens=256)
    ids = tokenize(smollm2, TEXT)
    shared = ids[:40]  # 2 full blocks of 16, plus 8 tokens
    first = [*shared, *tokenize(smollm2, " What does the cat count?")]
    second = [*shared, *tokenize(smollm2, " Where do the fishermen work?")]
    tokens, out = await run(engine, "first", first, 6)
    assert out.cached_tokens == 0 and tokens == hf_greedy(hf, first, 6)
    tokens, out = await run(engine, "second", second, 6)
    assert out.cached_tokens == 32
    assert tokens == hf_greedy(hf, second, 6)
