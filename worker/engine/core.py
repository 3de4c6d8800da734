"""The engine: a thread that runs the step loop, and the asyncio API around it.

One step is ``scheduler.schedule`` → ``runner.execute`` → ``sampler.sample``
→ ``scheduler.postprocess``. The engine thread owns every sequence, the block
pool and the scheduler; other threads reach them only through the command
queue (``generate``, ``abort``, ``pin_prefix``...) or under ``_lock`` for
read-only snapshots (``stats``, ``resident_block_hashes``). The lock is not
held while the model runs, so snapshots never wait for a forward pass.

Outputs go back to each request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``; the engine never waits on a consumer.

Hooks, all called on the engine thread and required not to block:

- ``on_events(events)``: once per step (or command) that changed the cache,
  with that step's ``contract.events``, while ``_lock`` is held, so a
  ``resident_block_hashes()`` snapshot equals all events handed to
  ``on_events`` so far, applied in order. It is not what Redis holds: the
  publisher sends those events later, from its own queue.
- ``on_request_finished(output, timings)``: once per finished request (any
  reason), with its ``RequestTimings`` (queue time, TTFT, every
  inter-token latency, end to end). Register more with
  ``add_finished_listener``. Exceptions in hooks are logged, never raised.

The engine works with any runner that has ``execute``, ``num_blocks``,
``block_size``, ``vocab_size``, ``max_model_len``, ``eos_token_ids`` and
``model_name`` (the unit tests use a fake one); torch is imported only by the
default sampler and for seeded requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from contract.events import KVEvent
from contract.hashing import HashSpec
from worker.engine.batch import Batch
from worker.engine.block_pool import BlockPool
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import RequestTimings, SamplingParams, validate_prompt
from worker.engine.sequence import Sequence as Seq
from worker.engine.types import (
    EngineConfig,
    EngineError,
    EngineStats,
    RateMeter,
    RequestOutput,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "RequestOutput",
    "RequestTimings",
]


FinishedHook = Callable[[RequestOutput, RequestTimings], None]
# An idle engine thread still goes round its loop this often, so "has not stepped
# for a while" always means stuck (or dead), never just idle.
_IDLE_BEAT_S = 0.25
_Command = Callable[[], None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class Engine:
    """Continuous-batching, prefix-caching inference over one model runner."""

    def __init__(
        self,
        runner: Any,
        config: EngineConfig,
        *,
        hash_spec: HashSpec,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        on_request_finished: FinishedHook | None = None,
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
        self._on_events = on_events
        self._finished_hooks: list[FinishedHook] = (
            [on_request_finished] if on_request_finished else []
        )
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        # Engine state vs. snapshot readers; re-entrant so a hook may call stats().
        self._lock = threading.RLock()
        self._streams_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._pin_results: dict[str, concurrent.futures.Future[int]] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.grammars: Any = None  # logits_processors.Grammars, set by the server (optional)
        self._beat = time.monotonic()  # last time the engine thread went round its loop
        self._rates = RateMeter(config.rate_ema_alpha)
        self._counters = dict.fromkeys(("prompt", "cached", "generation", "requests"), 0)

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (once)."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="kvroute-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stops the thread after its current step and finishes every request with ``abort``."""
        if self._thread is None or self._stopped:
            self._stopped = True
            return
        self._stopped = True
        self._commands.put(None)
        self._thread.join()
        # The thread is gone, so this thread owns the state now: run what was still queued
        # (so no caller of pin_prefix & co. waits forever), then end every sequence.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None:
                with self._lock:
                    command()
        with self._lock:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self.scheduler.abort(seq.request_id)
                self._emit(seq, [])
            self._flush_events()

    def step_age_s(self) -> float:
        """Seconds since the engine thread last went round its loop (idle or stepping).

        Lock-free, so it answers even while a step (or a stuck one) runs.
        """
        return max(0.0, time.monotonic() - self._beat)

    def health(self, stall_s: float) -> str | None:
        """Why the engine cannot serve (dead thread, no step for ``stall_s``), or None."""
        if self._thread is None or self._stopped or not self._thread.is_alive():
            return "the engine thread is not running"
        age = self.step_age_s()
        if age > stall_s:
            return f"the engine has not stepped for {age:.1f}s"
        return None

    def add_finished_listener(self, hook: FinishedHook) -> None:
        """Adds an ``on_request_finished`` hook (e.g. metrics attached after construction)."""
        self._finished_hooks.append(hook)

    # -- requests --------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
        lora: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs, one per step that gave it tokens, the last ``finished``.

        Raises ``ValueError`` for bad input before anything is queued.
        Closing or cancelling the iterator aborts the request and frees its
        blocks. Stop tokens (EOS, ``stop_token_ids``) are included in the
        output, as Hugging Face ``generate`` does.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt, lora)
        if params.json_schema is not None or params.grammar is not None:
            if self.grammars is None:
                raise ValueError("response_format: this worker has no structured output")
            # Compiled off the loop (the first one also builds the grammar tokenizer).
            seq.constraint = await asyncio.to_thread(
                self.grammars.matcher, params.json_schema, params.grammar
            )
        self._check_running()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        finished = False
        try:
            self._submit(lambda: self._add(seq))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._post(lambda: self._abort(request_id))

    def abort(self, request_id: str) -> bool:
        """Aborts an in-flight request; ``False`` if no stream with that id is open."""
        with self._streams_lock:
            found = request_id in self._streams
        if found:
            self._post(lambda: self._abort(request_id))
        return found

    def pin_prefix(
        self, token_ids: list[int], cache_salt: str = "", *, timeout: float | None = None
    ) -> int:
        """Computes ``token_ids`` (unless cached) and pins their full blocks; returns how many.

        Pinned blocks are never evicted (e.g. a system prompt every request
        shares). Blocks the calling thread until done: call it from a plain
        thread or ``asyncio.to_thread``, never from the engine's own hooks.
        """
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        seq = self._new_sequence(f"pin-{uuid.uuid4().hex}", token_ids, params, cache_salt, "")
        if seq.num_prompt_tokens < self.block_size:
            return 0
        seq.internal = True
        result: concurrent.futures.Future[int] = concurrent.futures.Future()

        def add() -> None:
            self._pin_results[seq.request_id] = result
            self.scheduler.add(seq)

        self._submit(add)
        return result.result(timeout)

    def reset_prefix_cache(self, *, timeout: float | None = None) -> bool:
        """Forgets every cached block (``AllBlocksCleared``); ``False`` while blocks are in use."""
        return self._call(self.pool.reset, timeout)

    # -- snapshots (any thread) ------------------------------------------

    def stats(self) -> EngineStats:
        """A consistent snapshot of load, block usage, rates and totals."""
        with self._lock:
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
                prompt_tokens_total=c["prompt"],
                cached_prompt_tokens_total=c["cached"],
                generation_tokens_total=c["generation"],
                evictions_total=pool.evictions_total,
                preemptions_total=sched.preemptions_total,
                requests_total=c["requests"],
            )

    def resident_block_hashes(self) -> set[int]:
        """Every block hash the pool holds now (consistent with the events delivered so far)."""
        with self._lock:
            return self.pool.resident_hashes()

    # -- engine thread ---------------------------------------------------

    def _run(self) -> None:
        while True:
            self._beat = time.monotonic()
            if not self._drain_commands(block=not self.scheduler.has_work()):
                return
            try:
                self._step()
            except Exception as exc:  # a bug must fail requests, not hang them forever
                logger.exception("engine step failed")
                try:
                    self._fail(list(self.scheduler.running), exc)
                except Exception:
                    logger.exception("engine state is inconsistent; stopping the engine")
                    self._die(exc)
                    return

    def _drain_commands(self, *, block: bool) -> bool:
        """Runs queued commands; ``False`` on shutdown. Waits for one only when idle."""
        try:
            command = (
                self._commands.get(timeout=_IDLE_BEAT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return True
        with self._lock:
            while command is not None:
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
            self._flush_events()
        return command is not None

    def _step(self) -> None:
        with self._lock:
            batch = self.scheduler.schedule()
            for seq in self.scheduler.take_dropped():
                self._emit(seq, [])
            if not batch:
                self._flush_events()
                return
        started = time.perf_counter()
        try:
            logits = self.runner.execute(batch.chunks)
            tokens = self._sample(logits, batch)
        except Exception as exc:
            logger.exception("model step failed for %d sequences", len(batch.seqs))
            self._fail(batch.seqs, exc)
            return
        elapsed = time.perf_counter() - started
        now = time.monotonic()
        with self._lock:
            for seq in self.scheduler.postprocess(batch, tokens, now):
                self._emit(seq, [seq.token_ids[-1]])
            self._rates.update(batch.num_prefill_tokens, batch.num_decode_tokens, elapsed)
            self._flush_events()

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

    def _add(self, seq: Seq) -> None:
        try:
            self.scheduler.add(seq)
        except ValueError as exc:  # an id whose previous request is still being aborted
            self._deliver(seq.request_id, exc)

    def _die(self, exc: Exception) -> None:
        """Stops accepting work and fails every open stream (the engine thread is ending)."""
        self._stopped = True
        with self._streams_lock:
            ids = list(self._streams)
        for request_id in ids:
            self._deliver(request_id, EngineError(f"engine stopped: {exc}"))

    def _abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._emit(seq, [])

    def _fail(self, seqs: Sequence[Seq], exc: Exception) -> None:
        with self._lock:
            for seq in seqs:
                if self.scheduler.abort(seq.request_id) is None:
                    continue
                self._emit(seq, [], error=EngineError(f"engine step failed: {exc}"))
            self._flush_events()

    def _emit(self, seq: Seq, new_tokens: list[int], error: BaseException | None = None) -> None:
        """Counts and delivers one output of ``seq`` (called with ``_lock`` held)."""
        first = len(seq.token_times) == len(new_tokens)
        if not seq.internal:
            if first and seq.num_cached_tokens is not None:
                self._counters["prompt"] += seq.num_prompt_tokens
                self._counters["cached"] += seq.num_cached_tokens
            self._counters["generation"] += len(new_tokens)
            if seq.is_finished:
                self._counters["requests"] += 1
        output = RequestOutput(
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
        if seq.internal:
            if seq.is_finished:
                self._finish_pin(seq)
            return
        self._deliver(seq.request_id, error if error is not None else output)
        if seq.is_finished:
            timings = seq.timings(time.monotonic())
            for hook in self._finished_hooks:
                try:
                    hook(output, timings)
                except Exception:
                    logger.exception("on_request_finished hook failed")

    def _finish_pin(self, seq: Seq) -> None:
        result = self._pin_results.pop(seq.request_id)
        if seq.finish_reason == "abort":
            result.set_exception(EngineError("pin_prefix: the prefix could not be computed"))
            return
        n_full = seq.num_prompt_tokens // self.block_size
        hits = self.pool.match_prefix(seq.block_hashes[:n_full], seq.prompt_token_ids)
        self.pool.pin(hits)
        result.set_result(len(hits))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            logger.debug("dropping output for %s: event loop closed", request_id)

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:
                logger.exception("on_events hook failed; %d events lost", len(events))

    # -- helpers (any thread) --------------------------------------------

    def _check_running(self) -> None:
        if self._thread is None or self._stopped:
            raise RuntimeError("the engine is not running (call start())")

    def _submit(self, command: _Command) -> None:
        self._check_running()
        self._commands.put(command)

    def _post(self, command: _Command) -> bool:
        """Like ``_submit`` for best-effort commands (aborts): ``False`` once stopped."""
        if self._thread is None or self._stopped:
            return False
        self._commands.put(command)
        return True

    def _call(self, fn: Callable[[], Any], timeout: float | None) -> Any:
        """Runs ``fn`` on the engine thread and returns its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._submit(command)
        return future.result(timeout)

    def _spec(self, cache_salt: str, lora: str) -> HashSpec:
        return self.hash_spec.with_salt(cache_salt).with_lora(lora)

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str,
        lora: str,
    ) -> Seq:
        """Validates a request (``ValueError``) and builds its sequence."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        prompt = validate_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        return Seq(request_id, prompt, params, self._spec(cache_salt, lora))
