"""The engine's public value types: limits, per-step outputs, stats, errors, meters.

Kept apart from ``worker.engine.core`` (the step) and ``worker.engine.thread``
(the thread and its asyncio API) so servers, metrics and tests can use them
without reading the loop; ``worker.engine.thread`` re-exports the public names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits (the model runner decides block size and pool size)."""

    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's (capped by the pool)
    enable_prefix_caching: bool = True
    rate_ema_alpha: float = 0.2  # weight of the newest step in the tokens/s averages

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if not 0.0 < self.rate_ema_alpha <= 1.0:
            raise ValueError(f"rate_ema_alpha must be in (0, 1], got {self.rate_ema_alpha}")


@dataclass
class RequestOutput:
    """One step's news for one request; the last one has ``finished=True``."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from cached full blocks
    completion_tokens: int
    ttft_s: float | None  # engine-side, set from the first token on
    # One per new token when the request asked for logprobs (logits_processors.TokenLogprob).
    new_logprobs: list[Any] = field(default_factory=list)


@dataclass
class EngineStats:
    """A snapshot of the engine (gauges, measured rates, and monotonic totals)."""

    running: int
    waiting: int
    queued_prefill_tokens: int
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    pinned_blocks: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    generation_tokens_total: int
    evictions_total: int
    preemptions_total: int
    requests_total: int


class RateMeter:
    """Recent prefill and decode throughput, from the engine's steps.

    A step with prefill tokens samples the prefill rate with *all* its tokens
    (decode tokens ride along at about the same cost per token) against its
    time. The rate reported is the marginal one: the slope of step time over
    step tokens, fitted over recent prefill steps (weights decaying by
    ``1 - alpha`` a step), because a step also has a fixed cost (every weight
    read once, scheduling) that a longer prompt does not repeat. Tokens over
    time instead made a worker that happened to get short prompts look
    several times slower than one that got long ones; the router then sent it
    only short prompts, and it stayed "slow" (the emulated Mooncake replay:
    a third of the fleet got 0.2-0.3 % of the prompt tokens each). Until the
    recent steps differ enough in size to fit a slope, and never outside
    ``[1, MAX_MARGINAL]`` times it, the rate is their tokens over their time.
    A step with decode tokens samples the decode rate as its decode tokens
    over its time: the generation throughput actually delivered.
    """

    MAX_MARGINAL = 8.0  # a slope this far above tokens/time is noise, not a fixed cost
    MIN_SPREAD = 0.25  # step sizes' deviation, relative to their mean, needed for a slope

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.prefill = 0.0
        self.decode = 0.0
        # Decayed sums over prefill steps: weight, tokens, seconds, tokens^2, tokens*seconds.
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)

    def update(self, prefill_tokens: int, decode_tokens: int, elapsed_s: float) -> None:
        if elapsed_s <= 0:
            return
        if prefill_tokens:
            self.prefill = self._fit(float(prefill_tokens + decode_tokens), elapsed_s)
        if decode_tokens:
            self.decode = self._mix(self.decode, decode_tokens / elapsed_s)

    def _fit(self, tokens: float, seconds: float) -> float:
        keep = 1.0 - self.alpha
        w, sx, sy, sxx, sxy = (s * keep for s in self._sums)
        w, sx, sy, sxx, sxy = (
            w + 1,
            sx + tokens,
            sy + seconds,
            sxx + tokens**2,
            sxy + tokens * seconds,
        )
        self._sums = (w, sx, sy, sxx, sxy)
        average = sx / sy
        mean_x, mean_y = sx / w, sy / w
        spread = sxx / w - mean_x**2
        if spread <= (self.MIN_SPREAD * mean_x) ** 2:
            return average
        slope = (sxy / w - mean_x * mean_y) / spread
        if slope <= 0:
            return average  # longer steps were not slower: noise, nothing to fit
        return min(max(1.0 / slope, average), self.MAX_MARGINAL * average)

    def _mix(self, old: float, sample: float) -> float:
        return sample if old == 0.0 else self.alpha * sample + (1.0 - self.alpha) * old


class EngineCounters:
    """Monotonic totals over client requests: prompt, cached and generated tokens, requests."""

    def __init__(self) -> None:
        self.prompt = 0
        self.cached = 0
        self.generation = 0
        self.requests = 0

    def count(self, seq: Any, new_tokens: list[int]) -> None:
        """Adds one output of ``seq`` (a ``worker.engine.sequence.Sequence``)."""
        if len(seq.token_times) == len(new_tokens) and seq.num_cached_tokens is not None:
            self.prompt += seq.num_prompt_tokens  # its first output: the prompt is settled
            self.cached += seq.num_cached_tokens
        self.generation += len(new_tokens)
        if seq.is_finished:
            self.requests += 1


class EngineError(RuntimeError):
    """The engine could not run a request's step (the runner or sampler failed)."""
