"""Registry records are untrusted input: each is checked before the router uses it.

Anything that can write to Redis can write a worker's hash, so every number a
record carries must be finite, non-negative and within a bound a real worker
could report. A record that fails is left out of routing (never a 500, never a
fleet-wide limit), with one log line per worker and reason and a count in
``kvroute_gateway_registry_records_rejected_total{reason}``. A worker whose
engine has not stepped for ``stall_s`` (its heartbeat says so) is left out too,
while another worker can serve.
"""

from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, Counter

from contract.redis_layout import WorkerRecord

logger = logging.getLogger(__name__)

# Generous bounds: far above any real worker, far below what breaks arithmetic.
_MAX_COUNT = 10_000_000  # sequences running or waiting
_MAX_TOKENS = 10**12  # queued prefill tokens
_MAX_BLOCKS = 10**10
_MAX_BLOCK_SIZE = 1 << 16
_MAX_MODEL_LEN = 1 << 27
_MAX_RATE = 1e9  # tokens per second
_MAX_ADDRESS = 512


def record_problem(rec: WorkerRecord) -> str | None:
    """Why ``rec`` must not be routed to (a short reason usable as a label), or None."""
    floats = (
        ("prefill_tokens_per_s", rec.prefill_tokens_per_s, _MAX_RATE),
        ("decode_tokens_per_s", rec.decode_tokens_per_s, _MAX_RATE),
        ("engine_step_age_s", rec.engine_step_age_s, 1e12),
        ("updated_at", rec.updated_at, 1e12),
    )
    for name, value, bound in floats:
        if not isinstance(value, float | int) or not math.isfinite(value):
            return f"{name}_not_finite"
        if not 0 <= value <= bound:
            return f"{name}_out_of_range"
    ints = (
        ("running", rec.running, _MAX_COUNT),
        ("waiting", rec.waiting, _MAX_COUNT),
        ("queued_prefill_tokens", rec.queued_prefill_tokens, _MAX_TOKENS),
        ("free_blocks", rec.free_blocks, _MAX_BLOCKS),
        ("num_blocks", rec.num_blocks, _MAX_BLOCKS),
        ("max_model_len", rec.max_model_len, _MAX_MODEL_LEN),
    )
    for name, value, bound in ints:
        if not 0 <= value <= bound:
            return f"{name}_out_of_range"
    if not 1 <= rec.block_size <= _MAX_BLOCK_SIZE:
        return "block_size_out_of_range"
    if not rec.address or len(rec.address) > _MAX_ADDRESS:
        return "bad_address"
    return None


class RecordCheck:
    """Filters registry entries for routing; logs and counts each rejection once."""

    def __init__(self, registry: CollectorRegistry, *, stall_s: float) -> None:
        self.stall_s = stall_s
        self.rejected = Counter(
            "kvroute_gateway_registry_records_rejected",
            "Registry records left out of routing (malformed values, or a stalled engine)",
            ["reason"],
            registry=registry,
        )
        self._reported: dict[str, str] = {}  # worker id -> the reason last logged
        # worker id -> (the record last checked, its verdict). Records are frozen and
        # replaced on every heartbeat, so the same object has the same verdict: a
        # request re-checks only what changed (1,000 records cost ~1 ms otherwise).
        self._verdicts: dict[str, tuple[WorkerRecord, str | None]] = {}

    def problem(self, rec: WorkerRecord) -> str | None:
        """``record_problem``, or ``engine_stalled``; logs and counts a new reason once."""
        seen = self._verdicts.get(rec.worker_id)
        if seen is not None and seen[0] is rec:
            return seen[1]
        reason = self._check(rec)
        self._verdicts[rec.worker_id] = (rec, reason)
        return reason

    def _check(self, rec: WorkerRecord) -> str | None:
        reason = record_problem(rec)
        if reason is None and rec.engine_step_age_s > self.stall_s:
            reason = "engine_stalled"
        wid = rec.worker_id
        if reason is None:
            if self._reported.pop(wid, None) is not None:
                logger.info("worker %s: registry record usable again", wid)
            return None
        if self._reported.get(wid) != reason:
            self._reported[wid] = reason
            self.rejected.labels(reason).inc()
            logger.warning(
                "worker %s: left out of routing (%s; prefill rate %r, max_model_len %r, "
                "engine step age %r s)",
                wid,
                reason,
                rec.prefill_tokens_per_s,
                rec.max_model_len,
                rec.engine_step_age_s,
            )
        return reason

    def forget(self, worker_id: str) -> None:
        self._reported.pop(worker_id, None)
        self._verdicts.pop(worker_id, None)
