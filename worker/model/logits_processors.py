"""Logits processors and log-probabilities: what a request's options do to its next-token logits.

``process`` runs before the sampler on the rows that ask for something, in vLLM's
order: ``logit_bias`` is added, then the penalties are applied — ``repetition_penalty``
over prompt and generated tokens (a positive logit is divided by it, a negative one
multiplied), ``frequency_penalty`` times each generated token's count and
``presence_penalty`` once per generated token are subtracted — then ``min_p`` drops
tokens whose probability at the request's temperature is below ``min_p`` times the
likeliest one's. Rows that ask for nothing are never touched, so greedy output of
a plain request stays token-identical.

``response_format`` (``json_object`` / ``json_schema``) is constrained decoding with
llguidance: each such sequence owns an ``LLMatcher`` (``Grammars.matcher``) whose
token mask is applied last, so every sampled token keeps the text a prefix of a
document the schema accepts, and end-of-sequence is allowed only once it is complete.
A forced tool call (``openai_api.tools``) is the same with a Lark grammar: the call's
JSON inside the tags the model's chat template uses.

``token_logprobs`` reads log-probabilities from the model's raw logits (before any
processor, temperature or filter: vLLM's default ``raw_logprobs``), so a value is
exactly ``log_softmax(logits)[token]`` of the step that chose it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.engine.sequence import SamplingParams

GREEDY_BELOW = 1e-5  # as worker.model.sampler: below it a row is an argmax


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probability and the ``k`` likeliest alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


def needs_processing(params: Sequence[SamplingParams]) -> bool:
    return any(p.needs_processing for p in params)


class Grammars:
    """Compiles JSON schemas into per-sequence matchers over the model's tokenizer.

    The llguidance tokenizer is built on first use (about 2 s for a 49k vocabulary)
    from the model folder's own tokenizer, so workers that never see a
    ``response_format`` never pay for it.
    """

    def __init__(self, model_dir: Path | str) -> None:
        self._model_dir = str(model_dir)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf: Any = AutoTokenizer.from_pretrained(self._model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf)
            return self._tokenizer

    def matcher(self, json_schema: str | None, grammar: str | None = None) -> Any:
        """A fresh ``LLMatcher`` for ``json_schema`` (JSON text) or a Lark ``grammar``
        (a forced tool call; it wins when both are given); ``ValueError`` if invalid."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        what = "tools: the tool-call grammar" if grammar else "response_format: the JSON schema"
        try:
            if grammar is not None:
                compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
            elif json_schema is None:
                raise ValueError("neither a JSON schema nor a grammar")
            else:
                # No free whitespace: a small model could otherwise spend its tokens on it.
                compiled = llguidance.LLMatcher.grammar_from_json_schema(
                    json_schema, defaults={"whitespace_flexible": False}
                )
        except (ValueError, RuntimeError, TypeError) as exc:
            raise ValueError(f"{what} is not usable: {exc}") from exc
        matcher = llguidance.LLMatcher(tokenizer, compiled)
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(f"{what} is not usable: {error}")
        return Constraint(matcher, int(tokenizer.vocab_size))


@dataclass
class Constraint:
    """One sequence's grammar state (an ``LLMatcher``) and the tokenizer's vocabulary size."""

    matcher: Any
    vocab: int

    def mask(self, row: torch.Tensor) -> None:
        """Sets to -inf every logit the grammar forbids next (and ids past the vocabulary)."""
        import llguidance.torch

        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab)
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        bits = bitmask[0].to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(32, dtype=torch.int64)
        allowed = ((bits[:, None] >> shifts[None, :]) & 1).flatten()[: self.vocab].bool()
        row[: self.vocab].masked_fill_(~allowed.to(row.device), float("-inf"))
        row[self.vocab :] = float("-inf")

    def accept(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)


def advance(constraints: Sequence[Constraint | None], tokens: Sequence[int]) -> None:
    """Feeds each constrained row's sampled token to its grammar."""
    for constraint, token in zip(constraints, tokens, strict=True):
        if constraint is not None:
            constraint.accept(int(token))


def process(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    constraints: Sequence[Constraint | None] = (),
) -> torch.Tensor:
    """``logits`` [N, vocab] with each row's processors applied (a new tensor if any applies).

    ``token_ids[i]`` is row i's prompt followed by what it generated so far;
    ``prompt_lens[i]`` says where the prompt ends.
    """
    rows = [i for i, p in enumerate(params) if p.needs_processing]
    if not rows:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i in rows:
        p = params[i]
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=row.device))
        tokens = token_ids[i]
        if p.repetition_penalty != 1.0 and tokens:
            seen = torch.tensor(sorted(set(tokens)), device=row.device)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        generated = tokens[prompt_lens[i] :]
        if (p.frequency_penalty or p.presence_penalty) and generated:
            counts = torch.bincount(torch.tensor(generated, device=row.device), minlength=vocab).to(
                row.dtype
            )
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.min_p > 0.0 and p.temperature >= GREEDY_BELOW:
            # p_j < min_p * p_max  <=>  (l_j - l_max) / T < ln(min_p)
            floor = row.max() + p.temperature * math.log(p.min_p)
            row.masked_fill_(row < floor, float("-inf"))
        constraint = constraints[i] if i < len(constraints) else None
        if constraint is not None:
            constraint.mask(row)
    return out


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """Per row, the chosen token's log-probability (and top ``params[i].logprobs``), or None."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return result
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
    for j, i in enumerate(rows):
        token = int(tokens[i])
        n = params[i].logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if n and top_vals is not None and top_ids is not None:
            top = tuple(
                (int(t), float(v))
                for t, v in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True)
            )
        result[i] = TokenLogprob(token, float(logp[j, token]), top)
    return result
