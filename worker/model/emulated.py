"""The emulated model runner: the ModelRunner seam, with a time model instead of a forward pass.

``kvroute worker --engine emulated --profile NAME`` keeps every real part of
a worker — block pool, scheduler, publisher, gRPC and HTTP fronts, metrics —
and replaces only ``ModelRunner.execute``: each step sleeps for the time the
profile predicts for that step's chunks and returns one deterministic token
id per chunk that asks for logits. No weights, no torch: an emulated worker
needs only its tokenizer, so dozens fit on a small machine. It is a
benchmark instrument for routing studies, never a serving mode.

The time model of one step (all coefficients in seconds, from the profile):

    t = step_s
      + prefill_token_s   * prefill tokens
      + prefill_pair_s    * sum over prefill chunks of n * (start + (n + 1) / 2)
      + decode_seq_s      * decode chunks
      + decode_context_s  * sum over decode chunks of their context length
      + logits_row_s      * chunks that ask for logits

A chunk of one token is a decode (the runner batches those together, and a
fully cached prompt's last token costs what a decode costs). The pair term is
prefill attention: each new query attends to its earlier context. Profiles
live in ``worker/model/profiles/*.json`` with their sources.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import xxhash

logger = logging.getLogger(__name__)

PROFILES_DIR = Path(__file__).with_name("profiles")
# Output tokens cycle over these words, so emulated text reads as words and
# re-tokenizes to the same ids when a chat client sends a reply back.
OUTPUT_WORDS = [
    "",
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "or",
    "an",
    "are",
    "not",
    "have",
    "but",
    "one",
    "all",
    "which",
    "there",
    "can",
    "more",
    "time",
    "when",
    "out",
    "some",
    "very",
    "so",
    "up",
    "what",
    "about",
    "into",
    "than",
    "them",
    "only",
    "other",
    "new",
    "like",
    "then",
    "also",
    "two",
    "first",
    "any",
    "these",
    "way",
    "may",
    "people",
    "could",
    "over",
    "well",
][1:]


@dataclass(frozen=True)
class TimeModel:
    """Seconds per step, per token, per attention pair (see the module docstring)."""

    step_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_pair_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_context_s: float = 0.0
    logits_row_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"--profile: time_model.{f.name} must be a number >= 0")

    def step_time(self, chunks: Sequence[Any]) -> float:
        """Predicted seconds for one step over ``chunks`` (``SeqChunk``-shaped)."""
        if not chunks:
            return 0.0
        prefill_tokens = pairs = decodes = context = rows = 0.0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 1:
                decodes += 1
                context += chunk.start_pos + 1
            else:
                prefill_tokens += n
                pairs += n * (chunk.start_pos + (n + 1) / 2)
            if chunk.need_logits:
                rows += 1
        return (
            self.step_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_pair_s * pairs
            + self.decode_seq_s * decodes
            + self.decode_context_s * context
            + self.logits_row_s * rows
        )

    def prefill_time(self, tokens: int, start: int = 0) -> float:
        """One prompt of ``tokens`` uncached tokens after ``start`` cached ones, alone in a step."""
        if tokens <= 1:
            return self.step_s + self.decode_seq_s + self.decode_context_s * (start + 1)
        pairs = tokens * (start + (tokens + 1) / 2)
        return (
            self.step_s
            + self.prefill_token_s * tokens
            + self.prefill_pair_s * pairs
            + self.logits_row_s
        )

    def decode_time(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences of ``context`` tokens each."""
        return (
            self.step_s
            + (self.decode_seq_s + self.logits_row_s) * batch
            + self.decode_context_s * batch * context
        )


@dataclass(frozen=True)
class Profile:
    """One emulated hardware/model pair: its time model and KV capacity, plus provenance."""

    name: str
    time_model: TimeModel
    kv_capacity_tokens: int
    max_model_len: int
    description: str = ""
    sources: tuple[str, ...] = ()

    def num_blocks(self, block_size: int) -> int:
        """Blocks of ``block_size`` tokens the emulated KV cache holds."""
        return max(1, self.kv_capacity_tokens // block_size)


def resolve_profile(name: str) -> Path:
    """A profile name (``worker/model/profiles/NAME.json``) or a path to a JSON file."""
    if not name:
        raise ValueError("--profile is required with --engine emulated")
    path = Path(name).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = PROFILES_DIR / f"{name}.json"
    if candidate.is_file():
        return candidate
    known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
    raise ValueError(f"--profile {name!r}: no such file or profile (known: {known})")


def load_profile(name: str) -> Profile:
    """Reads and validates a profile; ``ValueError`` names ``--profile`` on any problem."""
    path = resolve_profile(name)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(TimeModel)}
        coefficients = {k: float(v) for k, v in raw["time_model"].items() if k in known}
        profile = Profile(
            name=str(raw.get("name", path.stem)),
            time_model=TimeModel(**coefficients),
            kv_capacity_tokens=int(raw["kv_capacity_tokens"]),
            max_model_len=int(raw["max_model_len"]),
            description=str(raw.get("description", "")),
            sources=tuple(str(s) for s in raw.get("sources", ())),
        )
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--profile {name!r}: cannot read {path}: {exc!r}") from exc
    if profile.kv_capacity_tokens < 1 or profile.max_model_len < 2:
        raise ValueError(f"--profile {name!r}: kv_capacity_tokens and max_model_len must be > 1")
    return profile


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """The ``config.json`` of an HF folder: vocab size, EOS ids, context length (no torch)."""
    path = Path(model_dir) / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model {model_dir}: the emulated engine needs {path}: {exc}") from exc
    return config


class EmulatedSampler:
    """The emulated runner's "logits" are already token ids; sampling passes them through."""

    uses_generators = False

    def sample(self, logits: Any, params: Sequence[Any], generators: Sequence[Any]) -> list[int]:
        return list(logits)


class EmulatedRunner:
    """Sleeps per the profile's time model and emits deterministic tokens (module docstring)."""

    def __init__(
        self,
        profile: Profile,
        model_dir: Path | str,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        output_token_ids: Sequence[int] = (),
        time_scale: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"--block-size {block_size}: must be >= 1")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"--num-blocks {num_blocks}: must be >= 1")
        if time_scale <= 0:
            raise ValueError(f"time_scale {time_scale}: must be positive")
        config = read_model_config(Path(model_dir))
        eos = config.get("eos_token_id", ())
        self.profile = profile
        self.model_name = Path(model_dir).name
        self.block_size = block_size
        self.num_blocks = num_blocks or profile.num_blocks(block_size)
        self.vocab_size = int(config.get("vocab_size", 0)) or 32000
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (int(eos),)
        self.max_model_len = profile.max_model_len
        self.time_scale = time_scale
        ids = [t for t in output_token_ids if t not in self.eos_token_ids]
        # Without a tokenizer, any id above the special tokens will do.
        self.output_token_ids = ids or list(range(1000, 1064))
        self._sleep = sleep
        self.steps = 0
        self.busy_s = 0.0
        logger.info(
            "emulated %s with profile %s: %d KV blocks of %d tokens, time scale %g",
            self.model_name,
            profile.name,
            self.num_blocks,
            block_size,
            time_scale,
        )

    def next_token(self, last_token: int, position: int) -> int:
        """The token after ``last_token`` at ``position``: same inputs, same token, anywhere."""
        digest = xxhash.xxh3_64_intdigest(f"{last_token}:{position}".encode())
        return self.output_token_ids[digest % len(self.output_token_ids)]

    def execute(self, chunks: Sequence[Any]) -> list[int]:
        """Sleeps for the step's predicted time; one token id per chunk with ``need_logits``."""
        for chunk in chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            if not chunk.token_ids or end > self.max_model_len:
                raise ValueError(f"chunk positions [{chunk.start_pos}, {end}) are out of range")
            if len(chunk.block_table) * self.block_size < end:
                raise ValueError(
                    f"block table of {len(chunk.block_table)} blocks cannot hold {end} positions"
                )
        seconds = self.profile.time_model.step_time(chunks) * self.time_scale
        started = time.perf_counter()
        tokens = [
            self.next_token(c.token_ids[-1], c.start_pos + len(c.token_ids))
            for c in chunks
            if c.need_logits
        ]
        remaining = seconds - (time.perf_counter() - started)
        if remaining > 0:
            self._sleep(remaining)
        self.steps += 1
        self.busy_s += seconds
        return tokens


def output_token_ids(tokenizer: Any) -> list[int]:
    """The ids of ``OUTPUT_WORDS`` that are single tokens for this tokenizer."""
    ids: list[int] = []
    for word in OUTPUT_WORDS:
        encoded = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(encoded) == 1 and encoded[0] not in ids:
            ids.append(int(encoded[0]))
    return ids
