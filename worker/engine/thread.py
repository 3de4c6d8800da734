"""The engine thread: it owns an ``EngineCore`` and runs its step loop; asyncio talks to it.

The thread owns every sequence, the block pool and the scheduler; other
threads reach them only through the command queue (``generate``, ``abort``,
``pin_prefix``...) or under the core's lock for read-only snapshots
(``stats``, ``resident_block_hashes``). Outputs go back to each request's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``; the engine never waits
on a consumer, and a consumer that falls behind gets what piled up as one
merged output (``generate``), so a busy reader sends fewer, larger messages
(``worker.engine.output_stream``).

Hooks, all called on the engine thread and required not to block:

- ``on_events(events)``: once per step (or command) that changed the cache,
  with that step's ``contract.events`` (see ``worker.engine.core``).
- ``on_request_finished(output, timings)``: once per finished request (any
  reason), with its ``RequestTimings`` (queue time, TTFT, every
  inter-token latency, end to end). Register more with
  ``add_finished_listener``. Exceptions in hooks are logged, never raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from contract.events import KVEvent
from contract.hashing import HashSpec
from worker.engine.core import EngineCore
from worker.engine.output_stream import OutputStream, merge_outputs
from worker.engine.sequence import RequestTimings, SamplingParams
from worker.engine.sequence import Sequence as Seq
from worker.engine.torch_thread import TorchThread
from worker.engine.types import (
    EngineConfig,
    EngineError,
    EngineStats,
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
    "merge_outputs",
]


FinishedHook = Callable[[RequestOutput, RequestTimings], None]
# An idle engine thread still goes round its loop this often, so "has not stepped
# for a while" always means stuck (or dead), never just idle.
_IDLE_BEAT_S = 0.25
_Command = Callable[[], None]


class Engine:
    """Continuous-batching, prefix-caching inference over one model runner, on its own thread."""

    def __init__(
        self,
        runner: Any,
        config: EngineConfig,
        *,
        hash_spec: HashSpec,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        on_request_finished: FinishedHook | None = None,
        sampler: Any = None,
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {stream_interval}")
        # Tokens a stream holds back before sending (1: send whatever is ready).
        self.stream_interval = stream_interval
        self.core = EngineCore(
            runner,
            config,
            hash_spec=hash_spec,
            on_output=self._on_output,
            on_events=on_events,
            sampler=sampler,
        )
        core = self.core
        self.config = config
        self.hash_spec = hash_spec
        self.runner, self.sampler = core.runner, core.sampler
        self.pool, self.scheduler = core.pool, core.scheduler
        self.block_size, self.num_blocks = core.block_size, core.num_blocks
        self.vocab_size, self.model_name = core.vocab_size, core.model_name
        self.eos_token_ids, self.max_model_len = core.eos_token_ids, core.max_model_len
        self._finished_hooks: list[FinishedHook] = (
            [on_request_finished] if on_request_finished else []
        )
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._queues_lock = threading.Lock()
        self._queues: dict[str, OutputStream] = {}
        self._pin_results: dict[str, concurrent.futures.Future[int]] = {}
        self._started = False
        self._loop_done = threading.Event()  # set when the step loop has returned
        self._stopped = False
        self.grammars: Any = None  # logits_processors.Grammars, set by the server (optional)
        self._beat = time.monotonic()  # last time the engine thread went round its loop

    # -- lifecycle -------------------------------------------------------

    def start(self, on: TorchThread | None = None) -> None:
        """Starts the step loop (once): on a thread of its own, or on ``on``, the thread
        that loaded the model (``worker.engine.torch_thread`` says why that matters)."""
        if self._started:
            raise RuntimeError("engine already started")
        self._started = True
        if on is not None:
            on.submit(self._loop)
        else:
            threading.Thread(target=self._loop, name="kvroute-engine", daemon=True).start()

    def shutdown(self) -> None:
        """Stops the thread after its current step and finishes every request with ``abort``."""
        if not self._started or self._stopped:
            self._stopped = True
            return
        self._stopped = True
        self._commands.put(None)
        self._loop_done.wait()
        # The thread is gone, so this thread owns the state now: run what was still queued
        # (so no caller of pin_prefix & co. waits forever), then end every sequence.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None:
                with self.core.lock:
                    command()
        self.core.abort_all()

    def step_age_s(self) -> float:
        """Seconds since the engine thread last went round its loop (idle or stepping).

        Lock-free, so it answers even while a step (or a stuck one) runs.
        """
        return max(0.0, time.monotonic() - self._beat)

    def health(self, stall_s: float) -> str | None:
        """Why the engine cannot serve (dead thread, no step for ``stall_s``), or None."""
        if not self._started or self._stopped or self._loop_done.is_set():
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
        stream_interval: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs, the last ``finished``.

        Each output carries every token that is ready when the caller asks for
        the next one: a caller that keeps up gets one output per step, a slow
        one (its previous message still being sent) fewer, larger ones, merged
        by ``merge_outputs``. With ``stream_interval`` N > 1 (this request's,
        else the engine's) an output waits until it holds N tokens, except the
        first (TTFT) and the last.
        Raises ``ValueError`` for bad input before anything is queued.
        Closing or cancelling the iterator aborts the request and frees its
        blocks. Stop tokens (EOS, ``stop_token_ids``) are included in the
        output, as Hugging Face ``generate`` does.
        """
        seq = self.core.new_sequence(request_id, prompt_token_ids, params, cache_salt, lora)
        if params.json_schema is not None or params.grammar is not None:
            if self.grammars is None:
                raise ValueError("response_format: this worker has no structured output")
            # Compiled off the loop (the first one also builds the grammar tokenizer).
            seq.constraint = await asyncio.to_thread(
                self.grammars.matcher, params.json_schema, params.grammar
            )
        self._check_running()
        stream = OutputStream(asyncio.get_running_loop(), stream_interval or self.stream_interval)
        with self._queues_lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._queues[request_id] = stream
        try:
            self._submit(lambda: self._add(seq))
            async for out in stream:
                yield out
        finally:
            with self._queues_lock:
                self._queues.pop(request_id, None)
            if not stream.finished:
                self._post(lambda: self.core.abort(request_id))

    def abort(self, request_id: str) -> bool:
        """Aborts an in-flight request; ``False`` if no stream with that id is open."""
        with self._queues_lock:
            found = request_id in self._queues
        if found:
            self._post(lambda: self.core.abort(request_id))
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
        seq = self.core.new_sequence(f"pin-{uuid.uuid4().hex}", token_ids, params, cache_salt, "")
        if seq.num_prompt_tokens < self.block_size:
            return 0
        seq.internal = True
        result: concurrent.futures.Future[int] = concurrent.futures.Future()

        def add() -> None:
            self._pin_results[seq.request_id] = result
            self.core.add(seq)

        self._submit(add)
        return result.result(timeout)

    def reset_prefix_cache(self, *, timeout: float | None = None) -> bool:
        """Forgets every cached block (``AllBlocksCleared``); ``False`` while blocks are in use."""
        return self._call(self.pool.reset, timeout)

    # -- snapshots (any thread) ------------------------------------------

    def stats(self) -> EngineStats:
        """A consistent snapshot of load, block usage, rates and totals."""
        return self.core.stats()

    def resident_block_hashes(self) -> set[int]:
        """Every block hash the pool holds now (consistent with the events delivered so far)."""
        return self.core.resident_block_hashes()

    # -- engine thread ---------------------------------------------------

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            self._loop_done.set()

    def _run(self) -> None:
        while True:
            self._beat = time.monotonic()
            if not self._drain_commands(block=not self.core.has_work()):
                return
            try:
                self.core.step()
            except Exception as exc:  # a bug must fail requests, not hang them forever
                logger.exception("engine step failed")
                try:
                    self.core.fail(list(self.scheduler.running), exc)
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
        with self.core.lock:
            while command is not None:
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
            self.core.flush_events()
        return command is not None

    def _add(self, seq: Seq) -> None:
        try:
            self.core.add(seq)
        except ValueError as exc:  # an id whose previous request is still being aborted
            self._deliver(seq.request_id, exc)

    def _die(self, exc: Exception) -> None:
        """Stops accepting work and fails every open stream (the engine thread is ending)."""
        self._stopped = True
        with self._queues_lock:
            ids = list(self._queues)
        for request_id in ids:
            self._deliver(request_id, EngineError(f"engine stopped: {exc}"))

    def _on_output(self, seq: Seq, output: RequestOutput, error: BaseException | None) -> None:
        """The core's sink: a pin's end settles its future, a request's output goes to its queue."""
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
        with self._queues_lock:
            stream = self._queues.get(request_id)
        if stream is not None:
            stream.push(request_id, item)

    # -- helpers (any thread) --------------------------------------------

    def _check_running(self) -> None:
        if not self._started or self._stopped:
            raise RuntimeError("the engine is not running (call start())")

    def _submit(self, command: _Command) -> None:
        self._check_running()
        self._commands.put(command)

    def _post(self, command: _Command) -> bool:
        """Like ``_submit`` for best-effort commands (aborts): ``False`` once stopped."""
        if not self._started or self._stopped:
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
