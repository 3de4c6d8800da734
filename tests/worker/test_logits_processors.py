"""Logits processors and logprobs: exact values on tiny tensors, then through the real engine
(logprobs equal HF's log-softmax for the chosen tokens; penalties change greedy output)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from contract.hashing import HashSpec
from worker.engine.sequence import SamplingParams
from worker.engine.thread import Engine, EngineConfig
from worker.model.logits_processors import process, token_logprobs
from worker.model.runner import ModelRunner


def test_rows_that_ask_for_nothing_are_the_same_tensor() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert process(logits, [SamplingParams()], [[0, 1]], [1]) is logits


def test_repetition_presence_frequency_and_bias_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 10.0),)),
    ]
    # row 0: prompt [0], generated [1]; row 1: prompt [0], generated [2, 2]
    out = process(logits, params, [[0, 1], [0, 2, 2]], [1, 1])
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5]  # positive halved, negative doubled
    # token 2: 1.0 - 0.25 * 2 - 0.5; the prompt token 0 is not penalized; token 3 biased
    assert out[1].tolist() == [2.0, -2.0, 0.0, 10.5]
    assert logits[1].tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is untouched


def test_min_p_is_relative_to_the_likeliest_at_the_temperature() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = process(logits, [SamplingParams(min_p=0.25, temperature=1.0)], [[0]], [1])
    kept = torch.isfinite(out[0]).tolist()
    assert kept == [True, True, True, False]  # 0.05 < 0.25 * 0.5
    out = process(logits, [SamplingParams(min_p=0.25, temperature=2.0)], [[0]], [1])
    assert torch.isfinite(out[0]).all()  # hotter: sqrt(0.05/0.5) = 0.32 >= 0.25


def test_token_logprobs_are_log_softmax_with_top_k() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(logprobs=2), SamplingParams()]
    out = token_logprobs(logits, [0, 0], params)
    expected = torch.log_softmax(logits[0], -1)
    assert out[1] is None and out[0] is not None
    assert math.isclose(out[0].logprob, float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in out[0].top] == [2, 1]
    assert math.isclose(out[0].top[0][1], float(expected[2]), rel_tol=1e-6)


async def test_engine_logprobs_equal_hf_log_softmax_and_penalties_change_output(
    tiny_model: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(tiny_model, block_size=8, num_blocks=64)
    engine = Engine(
        runner, EngineConfig(), hash_spec=HashSpec(block_size=8, model=runner.model_name)
    )
    engine.start()
    try:
        prompt = [5, 9, 14, 3, 7, 22, 9, 14]
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        plain = [t async for o in engine.generate("a", prompt, greedy) for t in o.new_token_ids]
        with_lp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
        outs = [o async for o in engine.generate("b", prompt, with_lp)]
        tokens = [t for o in outs for t in o.new_token_ids]
        logprobs = [lp for o in outs for lp in o.new_logprobs]
        assert tokens == plain  # asking for logprobs does not change greedy output
        assert [lp.token_id for lp in logprobs] == tokens
        hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        with torch.no_grad():
            full = hf(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(full[len(prompt) - 1 : -1], dim=-1)
        for i, lp in enumerate(logprobs):
            assert abs(lp.logprob - float(expected[i, tokens[i]])) < 1e-3, i
            assert lp.top[0][0] == tokens[i]  # greedy: the chosen token is the likeliest
            assert len(lp.top) == 3
        # A strong repetition penalty forbids repeating any earlier token.
        penalized = SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
            presence_penalty=2.0, repetition_penalty=10.0,
        )  # fmt: skip
        out = [t async for o in engine.generate("c", prompt, penalized) for t in o.new_token_ids]
        assert len(set(out)) == len(out) and not set(out) & set(prompt), out
        banned = SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias=((plain[0], -100.0),)
        )
        out = [t async for o in engine.generate("d", prompt, banned) for t in o.new_token_ids]
        assert out[0] != plain[0]
    finally:
        engine.shutdown()


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


async def test_json_schema_output_validates_on_20_prompts(smollm2: Path) -> None:
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from worker.model.logits_processors import Grammars

    tok = AutoTokenizer.from_pretrained(smollm2)
    runner = ModelRunner(smollm2, block_size=16, num_blocks=1024)
    engine = Engine(runner, EngineConfig(), hash_spec=HashSpec(block_size=16, model="s"))
    engine.grammars = Grammars(smollm2)
    engine.start()
    schema = json.dumps(SCHEMA)
    topics = ["a baker", "a pilot", "a child", "a poet", "a doctor"]

    async def one(i: int) -> str:
        text = f"Invent {topics[i % 5]} (number {i}) and answer in JSON."
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tok.encode(rendered, add_special_tokens=False)
        params = SamplingParams(max_tokens=80, temperature=0.7, seed=i, json_schema=schema)
        out = [t async for o in engine.generate(f"j{i}", ids, params) for t in o.new_token_ids]
        return str(tok.decode(out, skip_special_tokens=True))

    try:
        texts = await asyncio.gather(*(one(i) for i in range(20)))
        with pytest.raises(ValueError, match="response_format"):
            bad = SamplingParams(max_tokens=4, json_schema='{"type": 5}')
            [o async for o in engine.generate("bad", [1, 2, 3], bad)]
    finally:
        engine.shutdown()
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
