"""The registry record a worker's heartbeat writes: its fixed fields and the engine's load.

``EngineView`` is what the publisher reads from an engine (a kvroute engine or
a bridged one); ``with_load`` fills a record's load fields from its stats.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

from contract.redis_layout import WorkerRecord


class EngineView(Protocol):
    """What the publisher reads from the engine (both calls are thread-safe snapshots)."""

    def stats(self) -> Any: ...

    def resident_block_hashes(self) -> set[int]: ...


def _step_age(engine: Any) -> float:
    """The engine's ``step_age_s()`` (engines without one, e.g. test fakes: 0)."""
    age = getattr(engine, "step_age_s", None)
    return float(age()) if age is not None else 0.0


def with_load(record: WorkerRecord, engine: EngineView) -> WorkerRecord:
    """``record`` with the engine's current load."""
    stats = engine.stats()
    return replace(
        record,
        num_blocks=int(stats.num_blocks),
        running=int(stats.running),
        waiting=int(stats.waiting),
        queued_prefill_tokens=int(stats.queued_prefill_tokens),
        free_blocks=int(stats.free_blocks),
        prefill_tokens_per_s=float(stats.prefill_tokens_per_s),
        decode_tokens_per_s=float(stats.decode_tokens_per_s),
        updated_at=time.time(),
        engine_step_age_s=_step_age(engine),
    )
