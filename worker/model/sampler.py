"""Sampler: turns a step's logits into one next token per sequence.

Greedy rows (temperature 0) are one batched argmax. The other rows are
scaled by their temperature, filtered by top-k and top-p in one batched
sort, and then drawn one row at a time, because each seeded request owns a
``torch.Generator`` and a draw must consume only that request's stream:
the same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engine.sequence import SamplingParams


def new_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A per-request generator seeded from ``params.seed``; None for unseeded requests."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


# Temperatures below this sample the argmax: at 1e-5 a logit gap of 0.001
# already gives odds of e**100, so nothing is lost, and nothing overflows.
GREEDY_BELOW = 1e-5


class Sampler:
    """Stateless: per-request randomness comes in through ``generators``."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """One token id per row of ``logits`` [N, vocab], using ``params[i]`` and ``generators[i]``."""
        rows = logits.shape[0]
        if len(params) != rows or len(generators) != rows:
            raise ValueError(
                f"sample: {rows} logit rows but {len(params)} params and "
                f"{len(generators)} generators"
            )
        if rows == 0:
            return []
        tokens = logits.argmax(dim=-1).tolist()
        # top_k == 1 is greedy however hot the temperature, and so is a temperature
        # too small to divide by (logits / 1e-40 overflows to inf and then nan).
        random_rows = [
            i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW and p.top_k != 1
        ]
        if not random_rows:
            return tokens
        picked = self._sample_random(
            logits[random_rows].float(),
            [params[i] for i in random_rows],
            [generators[i] for i in random_rows],
        )
        for row, token in zip(random_rows, picked, strict=True):
            tokens[row] = token
        return tokens

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        index: torch.Tensor | None = None
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # Stable, so ties keep vocabulary order and top-k=1 agrees with argmax.
            logits, index = logits.sort(dim=-1, descending=True, stable=True)
            ranks = torch.arange(vocab, device=logits.device)
            top_k = torch.tensor(
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device
            )
            logits = logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
            probs = logits.softmax(dim=-1)
            # top_p = 1 must keep every token, even if rounding lets the cumsum reach 1 early.
            top_p = torch.tensor(
                [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=logits.device
            )
            # Keep the smallest prefix whose mass reaches top_p: a token stays
            # if the mass before it is still below top_p (the first always stays).
            mass_before = probs.cumsum(dim=-1) - probs
            logits = logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        probs = logits.softmax(dim=-1)
        picked = []
        for i, generator in enumerate(generators):
            row = probs[i]
            if generator is not None and generator.device != row.device:
                row = row.to(generator.device)
            picked.append(int(torch.multinomial(row, 1, generator=generator).item()))
        if index is None:
            return picked
        return [int(index[i, p].item()) for i, p in enumerate(picked)]
