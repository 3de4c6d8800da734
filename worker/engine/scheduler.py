"""Continuous batching: which tokens of which sequences the next step computes.

There are no prefill and decode phases. Each step fills a budget of
``max_batch_tokens``: first one token for every running sequence that is
decoding, then the next chunk of every running sequence still in its prompt,
then new sequences from the waiting queue (FCFS) while blocks, the budget and
``max_num_seqs`` allow. A long prompt is thus computed in chunks across steps
while other sequences keep decoding (chunked prefill).

A sequence is admitted only when blocks for all its tokens fit. Its prefix
cache hit is found at admission: the confirmed run of cached full blocks is
shared (referenced) before any new block is allocated, and those tokens count
as computed, except that the last token is always computed, because its
logits give the first new token (as in vLLM: ``min(cached, num_tokens - 1)``;
when every block is a hit, that one token's KV is rewritten in place).

When a decoding sequence needs a new block and none is free, the newest
running sequence is preempted: its blocks are freed (its computed full blocks
stay cached), it goes back to the front of the waiting queue and is
recomputed later, usually from its own cached blocks. No torch here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from worker.engine.batch import Batch, SeqChunk
from worker.engine.block_pool import BlockPool
from worker.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and when a sequence must stop."""

    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_model_len: int = 2048
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")


class Scheduler:
    """Owns the waiting and running queues and every sequence's blocks."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.preemptions_total = 0
        self._by_id: dict[str, Sequence] = {}
        self._dropped: list[Sequence] = []

    # -- queue management ------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (``ValueError`` if its request id is in flight)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Finishes a sequence with reason ``abort``, freeing all its blocks at once."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_dropped(self) -> list[Sequence]:
        """Sequences finished by ``schedule`` itself (they can never fit the pool)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    @property
    def queued_prefill_tokens(self) -> int:
        """Tokens still to compute before every admitted or waiting sequence decodes."""
        waiting = sum(seq.num_uncomputed_tokens for seq in self.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in self.running if not s.is_decoding)

    # -- one step --------------------------------------------------------

    def schedule(self) -> Batch:
        """The chunks to compute next; an empty batch when there is nothing to do."""
        batch = Batch()
        budget = self.config.max_batch_tokens
        preempted = self.preemptions_total

        # 1. One token for each decoding sequence, oldest first, so decodes never starve.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            if not self._reserve_blocks(seq):
                continue
            batch.add(seq, self._chunk(seq, 1), decode=True)
            budget -= 1

        # 2. The next chunk of every admitted prompt (their blocks were reserved at admission).
        for seq in self.running:
            if budget == 0:
                break
            if seq.is_decoding:
                continue
            num = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, self._chunk(seq, num), decode=False)
            budget -= num

        # 3. Admit waiting sequences; not in a step that had to preempt (it would thrash).
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and self.preemptions_total == preempted
        ):
            seq = self.waiting[0]
            if not self._admit(seq):
                if not self.running:
                    # Nothing holds blocks but pins: this sequence can never fit.
                    logger.warning(
                        "request %s needs more KV blocks than the pool can give; dropped",
                        seq.request_id,
                    )
                    self.waiting.popleft()
                    self._finish(seq, "abort")
                    self._dropped.append(seq)
                    continue
                break
            self.waiting.popleft()
            self.running.append(seq)
            num = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, self._chunk(seq, num), decode=False)
            budget -= num
        return batch

    def postprocess(self, batch: Batch, sampled: list[int], now: float) -> list[Sequence]:
        """Applies a computed step; returns the sequences that got a new token.

        ``sampled`` holds one token per chunk with ``need_logits``, in batch
        order. Full blocks computed in this step become cached right here,
        generated tokens included; finished sequences release their blocks.
        """
        tokens = iter(sampled)
        out: list[Sequence] = []
        for seq, chunk in zip(batch.seqs, batch.chunks, strict=True):
            token = next(tokens) if chunk.need_logits else None
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += len(chunk.token_ids)
            self._register_computed_blocks(seq)
            if token is None:
                continue
            seq.append_token(token, now)
            reason = seq.stop_reason(self.config.eos_token_ids, self.config.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
            out.append(seq)
        return out

    # -- helpers ---------------------------------------------------------

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chunk(self, seq: Sequence, num: int) -> SeqChunk:
        start = seq.num_computed_tokens
        end = start + num
        return SeqChunk(
            token_ids=seq.token_ids[start:end],
            start_pos=start,
            block_table=seq.block_table[: self._num_blocks_for(end)],
            need_logits=end == seq.num_tokens,
        )

    def _admit(self, seq: Sequence) -> bool:
        """Takes the prefix hit and new blocks for all of ``seq``'s tokens, or nothing."""
        hits = self.pool.match_prefix(seq.block_hashes, seq.token_ids)
        num_new = self._num_blocks_for(seq.num_tokens) - len(hits)
        if not self.pool.can_allocate(num_new, hits):
            return False
        self.pool.touch(hits)  # before allocating, so the allocation cannot evict a hit
        new = self.pool.allocate(num_new)
        if new is None:  # can_allocate said yes; keep the pool consistent regardless
            self.pool.free(reversed(hits))
            return False
        cached = len(hits) * self.block_size
        seq.block_table = hits + new
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = min(cached, seq.num_tokens - 1)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        return True

    def _reserve_blocks(self, seq: Sequence) -> bool:
        """Blocks for every token of a decoding ``seq``, preempting the newest if needed.

        Returns ``False`` when ``seq`` itself had to be preempted.
        """
        num_new = self._num_blocks_for(seq.num_tokens) - len(seq.block_table)
        while num_new > 0:
            new = self.pool.allocate(num_new)
            if new is not None:
                seq.block_table += new
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._by_id[seq.request_id]

    def _release_blocks(self, seq: Sequence) -> None:
        # Tail-first: the end of the sequence is evicted before its (shared) prefix.
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _register_computed_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if full <= start:
            return
        bs = self.block_size
        self.pool.cache_blocks(
            seq.block_table[start:full],
            seq.block_hashes[start:full],
            seq.token_ids[start * bs : full * bs],
            seq.block_hashes[start - 1] if start else None,
        )
        seq.num_registered_blocks = full
