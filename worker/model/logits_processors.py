"""Logits processors and log-probabilities: what a request's options do to its next-token logits.

``process`` runs before the sampler on the rows that ask for something, in vLLM's
order: ``logit_bias`` is added, then the penalties are applied — ``repetition_penalty``
over prompt and generated tokens (a positive logit is divided by it, a negative one
multiplied), ``frequency_penalty`` times each generated token's count and
``presence_penalty`` once per generated token are subtracted — then ``min_p`` drops
tokens whose probability at the request's temperature is below ``min_p`` times the
likeliest one's. Rows that ask for nothing are never touched, so greedy output of
a plain request stays token-identical.

``token_logprobs`` reads log-probabilities from the model's raw logits (before any
processor, temperature or filter: vLLM's default ``raw_logprobs``), so a value is
exactly ``log_softmax(logits)[token]`` of the step that chose it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def process(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
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
