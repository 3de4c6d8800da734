"""A worker's load as the router should see it: the last heartbeat, corrected.

The registry's numbers lag a heartbeat. Requests this gateway saw finish since
it last saw the worker's record are taken off (first from the waiting queue —
a finish frees a slot that a waiting request takes — then from running), and
the queued prefill work is at least what this gateway itself sent and the
worker has not yet started. The fleet simulator calls the same function, so
simulated and production routing see load the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.routing.router import Row

if TYPE_CHECKING:  # the replicas module imports this one
    from gateway.routing.mirror_state import WorkerEntry
    from gateway.routing.replicas import PeerLoad


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


class LoadBook(dict[str, GatewayLoad]):
    """This gateway's ``GatewayLoad`` per worker, and which of them changed.

    ``touched`` holds the workers whose load changed since ``FleetColumns`` last
    read it: whoever changes a load adds its worker (the dispatcher when it sends
    and when a stream ends), so the router's columns redo those rows only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.touched: set[str] = set()

    def __setitem__(self, worker_id: str, load: GatewayLoad) -> None:
        super().__setitem__(worker_id, load)
        self.touched.add(worker_id)

    def of(self, worker_id: str) -> GatewayLoad:
        """``worker_id``'s load (created if missing), noted as about to change."""
        load = self.get(worker_id)
        if load is None:
            load = self[worker_id] = GatewayLoad()
        self.touched.add(worker_id)
        return load


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


def router_rows(
    entries: Sequence[WorkerEntry],
    loads: dict[str, GatewayLoad],
    cached: Mapping[str, int],
    block_count: Callable[[str], int],
    peers: Mapping[str, PeerLoad],
) -> tuple[list[str], list[Row]]:
    """The router's view of each worker, as ids and rows of ``WorkerState``'s fields
    after its id (``router.ROW_FIELDS``): its heartbeat record, corrected by this
    gateway's ``loads`` (created where missing).

    ``cached`` holds the request's cached blocks per worker, ``block_count`` the
    blocks the index holds for one, ``peers`` what the other gateway replicas have
    in flight there (``gateway.routing.replicas``). One loop with no call per
    worker but the index's count: at 1,000 workers the rows are most of routing.
    """
    ids: list[str] = []
    rows: list[Row] = []
    for e in entries:
        rec = e.record
        wid = rec.worker_id
        load = loads.get(wid)
        if load is None:
            load = loads[wid] = GatewayLoad()
        if load.heartbeat != rec.updated_at:
            load.saw_record(rec.updated_at)
        peer = peers.get(wid)
        inflight, pending, pending_prefill = (
            load.inflight,
            load.pending,
            load.pending_prefill_tokens,
        )
        if peer is not None:
            inflight += peer.inflight
            pending += peer.pending
            pending_prefill += peer.pending_prefill_tokens
        running, waiting, queued = rec.running, rec.waiting, rec.queued_prefill_tokens
        finished = load.finished - load.finished_at_heartbeat
        # The common case (nothing finished or pending, a busy worker) needs no correction.
        if finished or pending_prefill or not (running or waiting):
            running, waiting, queued = corrected_load(
                running, waiting, queued, finished, pending_prefill
            )
        ids.append(wid)
        rows.append(
            (
                cached.get(wid, 0),
                running,
                waiting,
                queued,
                rec.prefill_tokens_per_s,
                inflight,
                pending,
                block_count(wid),
                rec.num_blocks,
            )
        )
    return ids, rows
