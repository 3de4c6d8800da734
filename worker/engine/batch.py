"""What one engine step computes: the scheduler's output, the model runner's input.

``SeqChunk`` is the seam with the model runner: plain lists, no torch, so the
scheduler can be tested without a model. ``Batch`` pairs every chunk with the
sequence it belongs to, for the step's postprocessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.sequence import Sequence


@dataclass
class SeqChunk:
    """The tokens of one sequence to compute in this step."""

    token_ids: list[int]  # a prefill chunk or one decode token
    start_pos: int  # absolute position of token_ids[0] (= tokens already in KV)
    block_table: list[int]  # block ids covering positions [0, start_pos + len(token_ids))
    need_logits: bool  # False for a prefill chunk that does not end the prompt


@dataclass
class Batch:
    """One step: ``chunks[i]`` belongs to ``seqs[i]``; decode chunks come first."""

    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[SeqChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def add(self, seq: Sequence, chunk: SeqChunk, *, decode: bool) -> None:
        self.seqs.append(seq)
        self.chunks.append(chunk)
        if decode:
            self.num_decode_tokens += len(chunk.token_ids)
        else:
            self.num_prefill_tokens += len(chunk.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def sampled_seqs(self) -> list[Sequence]:
        """The sequences whose chunk asks for logits, in the order the runner returns them."""
        return [s for s, c in zip(self.seqs, self.chunks, strict=True) if c.need_logits]

    def __bool__(self) -> bool:
        return bool(self.chunks)
