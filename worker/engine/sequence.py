"""A sequence inside the engine: its tokens, its blocks, and how far its KV is computed.

``SamplingParams`` (what the client asked for) lives here too, because the
sequence is what carries it through the scheduler. A sequence has no
prefill/decode phase: ``num_computed_tokens`` says how many of its tokens
already have KV in its blocks, and the scheduler computes the rest. No torch.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

from contract.hashing import HashSpec, extend_block_hashes


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator, reproducible
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processors (worker.model.logits_processors), all off by default.
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of prompt+output tokens
    min_p: float = 0.0  # drops tokens below min_p x the likeliest token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: off; k: the chosen token's and the top k's log-probs
    json_schema: str | None = None  # response_format: output constrained to this JSON schema
    grammar: str | None = None  # a forced tool call: output constrained to this Lark grammar

    @property
    def needs_processing(self) -> bool:
        """True when some logits processor changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_p
            or self.logit_bias
            or self.json_schema is not None
            or self.grammar is not None
        )

    def validate(self, vocab_size: int) -> None:
        """Raises ``ValueError`` naming the field that is out of range."""
        self._validate_processors(vocab_size)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"stop_token_ids must be integers, got {token_id!r}")
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"stop_token_ids: {token_id} is outside the vocabulary")

    def _validate_processors(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, int | float) or not (
            0.0 < self.repetition_penalty <= 10.0
        ):
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}"
            )
        if not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias: {token_id} is outside the vocabulary")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: {bias} for {token_id} is outside [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def validate_prompt(
    prompt_token_ids: SequenceOf[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt as a list, or ``ValueError`` saying what is wrong with the request."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    for token_id in prompt:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"prompt token ids must be integers, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"prompt token id {token_id} is outside the vocabulary (size {vocab_size})"
            )
    params.validate(vocab_size)
    if len(prompt) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len {max_model_len}"
        )
    return prompt


@dataclass(frozen=True)
class RequestTimings:
    """Engine-side timings of a finished request, for latency histograms (seconds)."""

    queue_s: float | None  # arrival to first admission
    ttft_s: float | None  # arrival to first token
    inter_token_latencies_s: tuple[float, ...]  # between consecutive tokens
    e2e_s: float  # arrival to finish
    num_preemptions: int


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's state in the engine (owned by the engine thread)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hash_spec: HashSpec
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    block_hashes: list[int] = field(init=False)  # chain hash of every full block of token_ids
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_registered_blocks: int = 0  # leading blocks of block_table that are in the cache
    num_cached_tokens: int | None = None  # prompt tokens served by the cache (first admission)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    generator: Any = None  # the sampler's per-request RNG (seeded requests only)
    last_logprob: Any = None  # the newest token's TokenLogprob (requests with logprobs only)
    constraint: Any = None  # response_format's grammar state (logits_processors.Constraint)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    internal: bool = False  # engine-made (pin_prefix): not a client request, not in stats

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.block_hashes = extend_block_hashes((), self.token_ids, self.hash_spec)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when only the last sampled token is missing from the KV."""
        return (
            self.num_computed_tokens >= self.num_prompt_tokens and self.num_uncomputed_tokens == 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        """Adds a sampled token and hashes the block it completes, if any."""
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if len(self.token_ids) % self.hash_spec.block_size == 0:
            self.block_hashes += extend_block_hashes(
                self.block_hashes, self.token_ids, self.hash_spec
            )

    def stop_reason(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> str | None:
        """Why the sequence must stop after its last token (``None`` to go on)."""
        last = self.token_ids[-1]
        if not self.params.ignore_eos and last in eos_token_ids:
            return "stop"
        if last in self.params.stop_token_ids:
            return "stop"
        if self.num_completion_tokens >= self.params.max_tokens:
            return "length"
        if self.num_tokens >= max_model_len:
            return "length"
        return None

    def timings(self, now: float) -> RequestTimings:
        """The request's latencies so far, ``now`` being its finish time."""
        times = self.token_times
        scheduled = self.first_scheduled_time
        return RequestTimings(
            queue_s=None if scheduled is None else scheduled - self.arrival_time,
            ttft_s=times[0] - self.arrival_time if times else None,
            inter_token_latencies_s=tuple(b - a for a, b in itertools.pairwise(times)),
            e2e_s=now - self.arrival_time,
            num_preemptions=self.num_preemptions,
        )
