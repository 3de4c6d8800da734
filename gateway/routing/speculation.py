"""Speculative index entries: blocks a worker is assumed to hold before its events say so.

Right after a request is routed, its worker is assumed to hold the request's
blocks until its real cache events land, so a burst of siblings stays
together. The dispatcher holds the entries while the request waits for its
first token (a queued request's blocks are stored only when its prefill
runs, however long the queue) and then for a short grace, and withdraws them
when the worker fails the request. Entries expire from a heap ordered by expiry: ``prune`` costs
O(expired), not O(all). ``BlockIndex`` owns one and reads ``by_hash`` in its
lookup loop directly (a method call per block would double the walk's cost).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class Speculation:
    """hash -> {worker: expiry}, plus a heap of (expiry, n, worker, hashes) to expire them."""

    def __init__(self) -> None:
        self.by_hash: dict[int, dict[str, float]] = {}
        self._heap: list[tuple[float, int, str, tuple[int, ...]]] = []
        self.added = 0  # speculate() calls so far
        self.pairs = 0  # (hash, worker) entries, expired ones included until pruned

    def add(self, worker_id: str, hashes: Sequence[int], now: float, ttl: float) -> None:
        """Assumes ``worker_id`` holds ``hashes`` until ``now + ttl`` (monotonic seconds)."""
        if ttl <= 0 or not hashes:
            return
        expiry = now + ttl
        by_hash = self.by_hash
        for h in hashes:
            ws = by_hash.get(h)
            if ws is None:
                by_hash[h] = {worker_id: expiry}
                self.pairs += 1
            else:
                if worker_id not in ws:
                    self.pairs += 1
                ws[worker_id] = expiry
        self.added += 1
        heapq.heappush(self._heap, (expiry, self.added, worker_id, tuple(hashes)))

    def withdraw(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Forgets ``worker_id``'s entries for ``hashes`` at once (their heap items stay)."""
        by_hash = self.by_hash
        for h in hashes:
            ws = by_hash.get(h)
            if ws is not None and ws.pop(worker_id, None) is not None:
                self.pairs -= 1
                if not ws:
                    del by_hash[h]

    def prune(self, now: float, limit: int = 0) -> int:
        """Drops expired entries; returns how many went. O(expired).

        ``limit`` > 0 stops after about that many (a whole routing's chain at a
        time), so a caller on the event loop can yield between calls; lookups
        ignore expired entries either way.
        """
        gone = 0
        heap, by_hash = self._heap, self.by_hash
        while heap and heap[0][0] <= now and not (limit and gone >= limit):
            _, _, w, hashes = heapq.heappop(heap)
            for h in hashes:
                ws = by_hash.get(h)
                if ws is None:
                    continue
                exp = ws.get(w)
                if exp is not None and exp <= now:
                    del ws[w]
                    gone += 1
                    if not ws:
                        del by_hash[h]
        self.pairs -= gone
        return gone

    def drop_worker(self, worker_id: str) -> None:
        """Forgets every entry of ``worker_id`` (its heap items stay until they expire)."""
        for _, _, w, hashes in self._heap:
            if w == worker_id:
                self.withdraw(worker_id, hashes)

    def nbytes(self) -> int:
        """Estimated memory of the entries and the heap."""
        return len(self.by_hash) * 300 + len(self._heap) * 120
