"""Sampler: greedy, temperature, top-k, top-p and per-request seeded generators."""

from __future__ import annotations

import math

import pytest
import torch

from worker.engine.sequence import SamplingParams
from worker.model.sampler import Sampler, new_generator

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_for(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]] * rows)


def frequencies(params: SamplingParams, draws: int = 4000, seed: int = 0) -> list[float]:
    generator = new_generator(seed)
    tokens = Sampler().sample(logits_for(PROBS, draws), [params] * draws, [generator] * draws)
    return [tokens.count(t) / draws for t in range(len(PROBS))]


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    params = [SamplingParams(temperature=0.0)] * 3
    assert Sampler().sample(logits, params, [None] * 3) == [1, 0, 3]


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler()

    def run(neighbours: int) -> list[int]:
        generator = new_generator(7)
        out = []
        for _ in range(20):
            rows = torch.cat([logits[:1], logits[1 : 1 + neighbours]])
            others = [SamplingParams(temperature=1.0, seed=i) for i in range(neighbours)]
            gens = [generator] + [new_generator(100 + i) for i in range(neighbours)]
            out.append(sampler.sample(rows, [seeded, *others], gens)[0])
        return out

    alone, crowded = run(0), run(2)
    assert alone == crowded
    assert len(set(alone)) > 3  # really sampling, not greedy
    other_seed = [sampler.sample(logits[:1], [seeded], [new_generator(8)])[0] for _ in range(20)]
    assert other_seed != alone


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(8)]
    gens = [new_generator(i) for i in range(8)]
    assert Sampler().sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_vanishing_temperature_is_greedy_not_nan():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    for temperature in (1e-40, 1e-6):
        params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
        gens = [new_generator(i) for i in range(4)]
        assert Sampler().sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=i) for i in range(8)]
    gens = [new_generator(i) for i in range(8)]
    assert Sampler().sample(logits, params, gens) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), PROBS),
        # Temperature 0.5 squares the probabilities before renormalising.
        (SamplingParams(temperature=0.5), [p * p / sum(q * q for q in PROBS) for p in PROBS]),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
        # The mass before token 2 is 0.8 >= 0.7, so tokens 2 and 3 are cut.
        (SamplingParams(temperature=1.0, top_p=0.7), [0.625, 0.375, 0.0, 0.0]),
        (
            SamplingParams(temperature=1.0, top_k=3, top_p=0.9),
            [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
        ),
    ],
)
def test_distribution(params: SamplingParams, expected: list[float]):
    got = frequencies(params)
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) < 0.03, (got, expected)
        if e == 0.0:
            assert g == 0.0


def test_mixed_batch_keeps_row_order():
    logits = logits_for(PROBS, 3)
    logits[1] = torch.tensor([0.0, 0.0, 9.0, 0.0])
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1),
    ]
    tokens = Sampler().sample(logits, params, [None, None, new_generator(1)])
    assert tokens[:2] == [0, 2] and 0 <= tokens[2] < 4


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 logit rows"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [None])


def test_unseeded_requests_get_no_generator():
    assert new_generator(None) is None
    assert Sampler().sample(torch.zeros(0, 4), [], []) == []
