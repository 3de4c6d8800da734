"""The engine's throughput meter: the prefill rate a worker reports to the router."""

from __future__ import annotations

import random

import pytest

from worker.engine.types import RateMeter

FIXED_S = 0.018  # a step's fixed cost: every weight read once, scheduling
PER_TOKEN_S = 1 / 11_300


def step_s(tokens: int) -> float:
    return FIXED_S + tokens * PER_TOKEN_S


def test_short_prompts_do_not_make_a_worker_look_slow() -> None:
    # Two workers with the same engine: one happened to get short prompts, one long.
    short, long = RateMeter(0.2), RateMeter(0.2)
    for tokens in [57, 126, 144, 60, 93, 166, 58, 110]:
        short.update(tokens, 0, step_s(tokens))
    for tokens in [949, 1447, 1681, 1091, 2196, 1282, 1764, 2671]:
        long.update(tokens, 0, step_s(tokens))
    # Tokens over time said ~3,500 and ~9,900 tokens/s: the router then kept the
    # long prompts off the first. Both engines drain a queue at the same marginal rate.
    assert short.prefill == pytest.approx(11_300, rel=0.01)
    assert long.prefill == pytest.approx(11_300, rel=0.01)


def test_steps_of_one_size_report_tokens_over_time() -> None:
    meter = RateMeter(0.2)
    for _ in range(5):
        meter.update(500, 0, step_s(500))
    assert meter.prefill == pytest.approx(500 / step_s(500))  # nothing to fit a slope to


def test_noise_stays_within_the_bounds_of_tokens_over_time() -> None:
    rng = random.Random(0)
    meter = RateMeter(0.2)
    for _ in range(200):
        tokens = rng.randrange(50, 2000)
        meter.update(tokens, 0, step_s(tokens) * rng.uniform(0.3, 3.0))
        sx = meter._sums[1] / meter._sums[2]  # the recent steps' tokens over time
        assert sx <= meter.prefill <= RateMeter.MAX_MARGINAL * sx


def test_decode_rate_is_decode_tokens_over_time() -> None:
    meter = RateMeter(1.0)
    meter.update(0, 32, 0.01)
    assert meter.decode == pytest.approx(3200)
    assert meter.prefill == 0.0  # no prefill step yet
