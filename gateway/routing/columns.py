"""The router's rows of a large fleet, kept as one matrix between requests.

At 1,000 workers, building every worker's row (``load.router_rows``) was most
of routing's cost: ~1 us of Python per worker per request, for rows of which
a handful change between two requests. ``FleetColumns`` keeps the rows of the
healthy list as a numpy matrix (``router.ROW_FIELDS`` columns) and per request
redoes only:

- every row, when the healthy list is a new one (a record, a worker or a
  cooldown changed: about once per registry poll);
- the rows of workers whose load changed since (``LoadBook.touched``, and
  ``ReplicaSync.touched`` for the other replicas' loads);
- the index's block counts (one column, one call) and the request's cached
  blocks (one entry per holder).

The result equals ``router_rows`` over the same workers
(tests/gateway/test_columns.py plays random events against it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from gateway.routing.load import LoadBook, router_rows
from gateway.routing.mirror_state import WorkerEntry
from gateway.routing.replicas import PeerLoad
from gateway.routing.router import ROW_FIELDS

_CACHED = ROW_FIELDS.index("cached_blocks")
_HELD = ROW_FIELDS.index("held_blocks")


def _no_blocks(worker_id: str) -> int:
    return 0  # the held column is refreshed per request


class FleetColumns:
    """``router_rows`` of the healthy list, updated by what changed."""

    def __init__(self, loads: LoadBook) -> None:
        self.loads = loads
        self._of: list[WorkerEntry] | None = None  # the healthy list the matrix is of
        self._ids: list[str] = []
        self._pos: dict[str, int] = {}
        self._matrix = np.zeros((0, len(ROW_FIELDS)))

    def rows(
        self,
        healthy: list[WorkerEntry],
        entries: list[WorkerEntry],
        cached: Mapping[str, int],
        block_counts: Callable[[list[str]], list[int]],
        peers: Mapping[str, PeerLoad],
        peers_touched: set[str],
    ) -> tuple[list[str], np.ndarray] | None:
        """Ids and rows of ``entries`` (``healthy`` or a part of it, in its order) for
        this request; None when ``entries`` are not all in ``healthy`` (a list from
        before the fleet changed: ``router_rows`` then)."""
        touched = self.loads.touched
        if healthy is not self._of:
            self._rebuild(healthy, peers)
        elif touched or peers_touched:
            pos, matrix = self._pos, self._matrix
            for wid in (touched | peers_touched) & pos.keys():
                i = pos[wid]
                _, (row,) = router_rows([healthy[i]], self.loads, {}, _no_blocks, peers)
                matrix[i] = row
        touched.clear()
        peers_touched.clear()
        ids, matrix = self._ids, self._matrix.copy()
        if entries is not healthy:
            at = [self._pos.get(e.record.worker_id, -1) for e in entries]
            if -1 in at:
                return None
            ids, matrix = [ids[i] for i in at], matrix[at]
        matrix[:, _HELD] = block_counts(ids)
        if cached:
            pos = self._pos if entries is healthy else {w: i for i, w in enumerate(ids)}
            try:
                at, blocks = list(map(pos.__getitem__, cached)), list(cached.values())
            except KeyError:  # a holder the request does not consider (it did not fit)
                pairs = [(pos[w], b) for w, b in cached.items() if w in pos]
                at, blocks = [i for i, _ in pairs], [b for _, b in pairs]
            matrix[at, _CACHED] = blocks
        return ids, matrix

    def unused(self, peers_touched: set[str]) -> None:
        """The fleet is routed without the matrix (small, or another policy): the
        marks are dropped as they come (workers come and go under new names) and
        the matrix is rebuilt if it is needed again."""
        self.loads.touched.clear()
        peers_touched.clear()
        self._of = None

    def _rebuild(self, healthy: list[WorkerEntry], peers: Mapping[str, PeerLoad]) -> None:
        ids, rows = router_rows(healthy, self.loads, {}, _no_blocks, peers)
        self._of, self._ids = healthy, ids
        self._pos = {w: i for i, w in enumerate(ids)}
        self._matrix = np.array(rows, dtype=np.float64).reshape(len(ids), len(ROW_FIELDS))
