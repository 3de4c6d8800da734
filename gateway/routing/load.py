"""A worker's load as the router should see it: the last heartbeat, corrected.

The registry's numbers lag a heartbeat. Requests this gateway saw finish since
it last saw the worker's record are taken off (first from the waiting queue —
a finish frees a slot that a waiting request takes — then from running), and
the queued prefill work is at least what this gateway itself sent and the
worker has not yet started. The fleet simulator calls the same function, so
simulated and production routing see load the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.redis_layout import WorkerRecord
from gateway.routing.router import Row


@dataclass
class GatewayLoad:
    """What this gateway itself has in flight on one worker, and finishes since its heartbeat."""

    inflight: int = 0
    pending: int = 0  # sent, no first token yet
    pending_prefill_tokens: int = 0
    finished: int = 0  # total finishes this gateway saw on the worker
    finished_at_heartbeat: int = 0  # ``finished`` when the current record arrived
    heartbeat: float | None = None  # the record's own ``updated_at``, compared only to itself

    def saw_record(self, updated_at: float) -> None:
        """Notes the worker's current record; finishes before it are in its numbers."""
        if updated_at != self.heartbeat:
            self.heartbeat = updated_at
            self.finished_at_heartbeat = self.finished

    @property
    def finished_since_heartbeat(self) -> int:
        return self.finished - self.finished_at_heartbeat


def corrected_load(
    running: int,
    waiting: int,
    queued_prefill_tokens: int,
    finished_since: int,
    pending_prefill: int,
) -> tuple[int, int, int]:
    """(running, waiting, queued prefill tokens) after the finishes the heartbeat missed."""
    new_waiting = max(0, waiting - finished_since)
    new_running = max(0, running - max(0, finished_since - waiting))
    queued = queued_prefill_tokens if new_running + new_waiting else 0
    return new_running, new_waiting, max(queued, pending_prefill)


def router_row(
    rec: WorkerRecord,
    load: GatewayLoad,
    cached_blocks: int,
    held_blocks: int,
    peers: tuple[int, int, int] = (0, 0, 0),
) -> Row:
    """The router's view of a worker as a row of ``WorkerState``'s fields after its id
    (``router.ROW_FIELDS``): its heartbeat ``rec``, corrected by this gateway's ``load``.

    ``peers`` is what the other gateway replicas have in flight there
    (inflight, pending, pending prefill tokens; ``gateway.routing.replicas``).
    """
    if load.heartbeat != rec.updated_at:
        load.saw_record(rec.updated_at)
    pending_prefill = load.pending_prefill_tokens + peers[2]
    running, waiting, queued = rec.running, rec.waiting, rec.queued_prefill_tokens
    finished = load.finished - load.finished_at_heartbeat
    # The common case (nothing finished or pending, a busy worker) needs no correction.
    if finished or pending_prefill or not (running or waiting):
        running, waiting, queued = corrected_load(
            running, waiting, queued, finished, pending_prefill
        )
    return (
        cached_blocks,
        running,
        waiting,
        queued,
        rec.prefill_tokens_per_s,
        load.inflight + peers[0],
        load.pending + peers[1],
        held_blocks,
        rec.num_blocks,
    )
