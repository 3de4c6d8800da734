"""Speculative index entries: blocks a worker is assumed to hold before its events say so.

Right after a request is routed, its worker is assumed to hold the request's
blocks until its real cache events land, so a burst of siblings stays
together. The dispatcher holds the entries while the request waits for its
first token (a queued request's blocks are stored only when its prefill
runs, however long the queue) and then for a short grace, and withdraws them
when the worker fails the request. Entries expire from a heap ordered by expiry: ``prune`` costs
O(expired), not O(all).

``BlockIndex`` reads ``by_hash`` in its lookup loop directly (a method call
per block would double the walk's cost). Each hash's entry keeps, beside its
workers' expiries, the index's bitset of those workers and the soonest
expiry among them, valid for one generation of the index's ordinals: while
both hold, a lookup ORs one int per block instead of visiting each worker,
and renewing a live hold (every request renews its chain at its first
token) touches only its expiry. A look-up where 1,000 workers speculate a
64-block system prompt: 6.1 -> 0.19 ms. On a small fleet it is a wash: a
375-block chain held twice (routed, first token) and looked up once per
request, 259 -> 257 us with one worker speculating, 328 -> 258 us with four.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

INF = float("inf")
# An entry is one dict: worker id -> expiry, plus under these keys (a space is never
# in a worker id: ``contract.redis_layout.valid_worker_id``) the holders' bitset
# (index ordinals), the soonest expiry among them, the ordinal generation the two
# were computed in (STALE: recompute) and when a lookup last recomputed them (-inf:
# never; every worker added since has its bit). Only strings as keys (CPython's
# faster lookup) and ints, floats and strings as values: the garbage collector does
# not track such a dict, and a busy gateway holds hundreds of thousands (as lists
# they made its collections cost 10 % more CPU).
BITS, SOONEST, GENERATION, COMPUTED = " bits", " soonest", " generation", " computed"
META = 4  # keys of an entry that are not workers
STALE = -1


class Speculation:
    """hash -> entry (see above), plus a heap of (expiry, n, worker, hashes) to expire them."""

    def __init__(self) -> None:
        self.by_hash: dict[int, dict[str, Any]] = {}
        self._heap: list[tuple[float, int, str, tuple[int, ...]]] = []
        self.added = 0  # speculate() calls so far
        self.pairs = 0  # (hash, worker) entries, expired ones included until pruned

    def add(
        self,
        worker_id: str,
        hashes: Sequence[int],
        now: float,
        ttl: float,
        bit: int,
        generation: int,
    ) -> None:
        """Assumes ``worker_id`` (ordinal bit ``bit`` in the index's ``generation``)
        holds ``hashes`` until ``now + ttl`` (monotonic seconds)."""
        if ttl <= 0 or not hashes:
            return
        expiry = now + ttl
        by_hash = self.by_hash
        added = 0
        for h in hashes:
            e = by_hash.get(h)
            if e is None:
                by_hash[h] = {
                    BITS: bit,
                    SOONEST: expiry,
                    GENERATION: generation,
                    COMPUTED: -INF,
                    worker_id: expiry,
                }
                added += 1
                continue
            was = e.get(worker_id)
            e[worker_id] = expiry
            if was is not None and was > e[COMPUTED]:
                # A renewal of an entry live at the last recompute (or added since):
                # its bit is in BITS already; only a shorter hold moves SOONEST.
                if expiry < e[SOONEST]:
                    e[SOONEST] = expiry
                continue
            if was is None:
                added += 1
            if e[GENERATION] == generation:
                e[BITS] |= bit
                if expiry < e[SOONEST]:
                    e[SOONEST] = expiry
        self.pairs += added
        self.added += 1
        heapq.heappush(self._heap, (expiry, self.added, worker_id, tuple(hashes)))

    def withdraw(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Forgets ``worker_id``'s entries for ``hashes`` at once (their heap items stay)."""
        by_hash = self.by_hash
        for h in hashes:
            e = by_hash.get(h)
            if e is not None and e.pop(worker_id, None) is not None:
                self.pairs -= 1
                if len(e) > META:
                    e[GENERATION] = STALE
                else:
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
                e = by_hash.get(h)
                if e is None:
                    continue
                exp = e.get(w)
                if exp is not None and exp <= now:
                    # The bitset may keep w's bit: SOONEST is at most w's expiry, so no
                    # lookup from now on takes the cached bitset without recomputing.
                    del e[w]
                    gone += 1
                    if len(e) == META:
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
        return len(self.by_hash) * 380 + len(self._heap) * 120
