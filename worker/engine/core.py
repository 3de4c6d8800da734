"""The engine core: one model, its block pool and scheduler, and a short ``step()``.

One step is ``scheduler.schedule`` → ``runner.execute`` → ``sampler.sample``
→ ``scheduler.postprocess``, as in nano-vllm. The core has no thread and no
queue: ``worker.engine.thread.Engine`` runs it on its own thread and feeds it
commands; every method here runs on that thread (or on the caller's once the
thread is gone), except the read-only snapshots ``stats`` and
``resident_block_hashes``, which take ``lock``. ``step`` does not hold the
lock while the model runs, so snapshots never wait for a forward pass.

Each output goes to the ``on_output(seq, output, error)`` sink the thread
gives, after it has been counted; cache events go to ``on_events(events)``
once per step (or command) that changed the cache, with the lock held, so a
``resident_block_hashes()`` snapshot equals all events handed to ``on_events``
so far, applied in order. It is not what Redis holds: the publisher sends
those events later, from its own queue.

The core works with any runner that has ``execute``, ``num_blocks``,
``block_size``, ``vocab_size``, ``max_model_len``, ``eos_token_ids`` and
``model_name`` (the unit tests use a fake one); torch is imported only by the
default sampler and for seeded requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from contract.events import KVEvent
from contract.hashing import HashSpec
from worker.engine.batch import Batch
from worker.engine.block_pool import BlockPool
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import SamplingParams, validate_prompt
from worker.engine.sequence import Sequence as Seq
from worker.engine.types import (
    EngineConfig,
    EngineCounters,
    EngineError,
    EngineStats,
    RateMeter,
    RequestOutput,
)

logger = logging.getLogger(__name__)

# Where each counted output goes: (sequence, its output, the error to deliver instead or None).
OutputSink = Callable[[Seq, RequestOutput, "BaseException | None"], None]


class EngineCore:
    """Continuous-batching, prefix-caching inference over one model runner, one step at a time."""

    def __init__(
        self,
        runner: Any,
        config: EngineConfig,
        *,
        hash_spec: HashSpec,
        on_output: OutputSink,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        sampler: Any = None,
    ) -> None:
        if hash_spec.block_size != runner.block_size:
            raise ValueError(
                f"--block-size: hash spec uses {hash_spec.block_size}, "
                f"the model runner {runner.block_size}"
            )
        if config.max_model_len is not None and config.max_model_len > runner.max_model_len:
            raise ValueError(
                f"--max-model-len {config.max_model_len} exceeds the model's {runner.max_model_len}"
            )
        self.runner = runner
        self.config = config
        self.hash_spec = hash_spec
        self.block_size: int = runner.block_size
        self.num_blocks: int = runner.num_blocks
        self.vocab_size: int = runner.vocab_size
        self.model_name: str = runner.model_name
        self.eos_token_ids: tuple[int, ...] = tuple(runner.eos_token_ids)
        # A sequence must fit the pool on its own, or it could never be admitted.
        self.max_model_len: int = min(
            config.max_model_len or runner.max_model_len, self.num_blocks * self.block_size
        )
        if sampler is None:
            from worker.model.sampler import Sampler

            sampler = Sampler()
        self.sampler = sampler
        self.pool = BlockPool(
            self.num_blocks, self.block_size, enable_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_batch_tokens=config.max_batch_tokens,
                max_model_len=self.max_model_len,
                eos_token_ids=self.eos_token_ids,
            ),
            self.pool,
        )
        self._on_output = on_output
        self._on_events = on_events
        # Engine state vs. snapshot readers; re-entrant so a hook may call stats().
        self.lock = threading.RLock()
        self._rates = RateMeter(config.rate_ema_alpha)
        self._counters = EngineCounters()

    # -- the step --------------------------------------------------------

    def step(self) -> None:
        """Schedules, runs and samples one batch, then hands each sequence's news to the sink."""
        with self.lock:
            batch = self.scheduler.schedule()
            for seq in self.scheduler.take_dropped():
                self.emit(seq, [])
            if not batch:
                self.flush_events()
                return
        started = time.perf_counter()
        try:
            logits = self.runner.execute(batch.chunks)
            tokens = self._sample(logits, batch)
        except Exception as exc:
            logger.exception("model step failed for %d sequences", len(batch.seqs))
            self.fail(batch.seqs, exc)
            return
        elapsed = time.perf_counter() - started
        now = time.monotonic()
        with self.lock:
            for seq in self.scheduler.postprocess(batch, tokens, now):
                self.emit(seq, [seq.token_ids[-1]])
            self._rates.update(batch.num_prefill_tokens, batch.num_decode_tokens, elapsed)
            self.flush_events()

    def has_work(self) -> bool:
        """Whether a sequence is running or waiting (so the next ``step`` does something)."""
        return self.scheduler.has_work()

    def _sample(self, logits: Any, batch: Batch) -> list[int]:
        seqs = batch.sampled_seqs()
        if not seqs:
            return []
        # A sampler without per-request generators (the emulated one) never needs torch.
        seeded = getattr(self.sampler, "uses_generators", True)
        for seq in seqs:
            if seeded and seq.params.seed is not None and seq.generator is None:
                from worker.model.sampler import new_generator

                seq.generator = new_generator(seq.params.seed, logits.device)
        params = [s.params for s in seqs]
        if any(p.needs_processing or p.logprobs is not None for p in params):
            return self._sample_processed(logits, seqs, params)
        return list(self.sampler.sample(logits, params, [s.generator for s in seqs]))

    def _sample_processed(
        self, logits: Any, seqs: list[Seq], params: list[SamplingParams]
    ) -> list[int]:
        """Sampling with logits processors (penalties, bias, min_p) and/or logprobs."""
        from worker.model import logits_processors as lp

        constraints = [s.constraint for s in seqs]
        processed = lp.process(
            logits,
            params,
            [s.token_ids for s in seqs],
            [s.num_prompt_tokens for s in seqs],
            constraints,
        )
        tokens = list(self.sampler.sample(processed, params, [s.generator for s in seqs]))
        lp.advance(constraints, tokens)
        for seq, logprob in zip(seqs, lp.token_logprobs(logits, tokens, params), strict=True):
            seq.last_logprob = logprob
        return tokens

    # -- sequences in and out --------------------------------------------

    def new_sequence(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str,
        lora: str,
    ) -> Seq:
        """Validates a request (``ValueError``) and builds its sequence (any thread)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        prompt = validate_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        spec = self.hash_spec.with_salt(cache_salt).with_lora(lora)
        return Seq(request_id, prompt, params, spec)

    def add(self, seq: Seq) -> None:
        """Queues ``seq``; ``ValueError`` if its id is still in the scheduler."""
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Ends a request (``finish_reason`` ``abort``) and frees its blocks; unknown ids are ignored."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.emit(seq, [])

    def abort_all(self) -> None:
        """Aborts every running and waiting sequence (the engine is shutting down)."""
        with self.lock:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self.scheduler.abort(seq.request_id)
                self.emit(seq, [])
            self.flush_events()

    def fail(self, seqs: Sequence[Seq], exc: Exception) -> None:
        """Aborts ``seqs`` and delivers an ``EngineError`` to each instead of its last output."""
        with self.lock:
            for seq in seqs:
                if self.scheduler.abort(seq.request_id) is None:
                    continue
                self.emit(seq, [], error=EngineError(f"engine step failed: {exc}"))
            self.flush_events()

    def emit(self, seq: Seq, new_tokens: list[int], error: BaseException | None = None) -> None:
        """Counts one output of ``seq`` and hands it to the sink (called with ``lock`` held)."""
        if not seq.internal:
            self._counters.count(seq, new_tokens)
        self._on_output(seq, self._output(seq, new_tokens), error)

    def _output(self, seq: Seq, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            completion_tokens=seq.num_completion_tokens,
            ttft_s=seq.token_times[0] - seq.arrival_time if seq.token_times else None,
            new_logprobs=[seq.last_logprob] if new_tokens and seq.last_logprob else [],
        )

    def flush_events(self) -> None:
        """Hands the pool's new cache events to ``on_events`` (a failing hook loses them)."""
        events = self.pool.take_events()
        if events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:
                logger.exception("on_events hook failed; %d events lost", len(events))

    # -- snapshots (any thread) ------------------------------------------

    def stats(self) -> EngineStats:
        """A consistent snapshot of load, block usage, rates and totals."""
        with self.lock:
            sched, pool, c = self.scheduler, self.pool, self._counters
            return EngineStats(
                running=len(sched.running),
                waiting=len(sched.waiting),
                queued_prefill_tokens=sched.queued_prefill_tokens,
                num_blocks=pool.num_blocks,
                free_blocks=pool.num_free_blocks,
                used_blocks=pool.num_used_blocks,
                cached_blocks=pool.num_cached_blocks,
                pinned_blocks=pool.num_pinned_blocks,
                prefill_tokens_per_s=self._rates.prefill,
                decode_tokens_per_s=self._rates.decode,
                prompt_tokens_total=c.prompt,
                cached_prompt_tokens_total=c.cached,
                generation_tokens_total=c.generation,
                evictions_total=pool.evictions_total,
                preemptions_total=sched.preemptions_total,
                requests_total=c.requests,
            )

    def resident_block_hashes(self) -> set[int]:
        """Every block hash the pool holds now (equal to the events handed to ``on_events``)."""
        with self.lock:
            return self.pool.resident_hashes()
