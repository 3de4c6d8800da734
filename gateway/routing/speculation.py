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

The hashes one hold finds unclaimed share one entry: a cold 6k-token prompt's
375 blocks cost one dict, not 375, and its renewal at the first token and its
expiry change that one dict (copy on write keeps it exact: see ``Speculation``).
Same-run A/B (``bench_overhead --routers kvroute,kvroute_baseline``, three
rounds, two runs): a cold 6k chat's gateway CPU 5.54 -> 4.66 and 5.23 -> 4.35 ms
(0.84x, 0.83x); ``bench_scale``'s ``bench_prune(1_000_000)`` 494 -> 95 ms.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

INF = float("inf")
# An entry is one dict: worker id -> expiry, plus under these keys (a space is never
# in a worker id: ``contract.redis_layout.valid_worker_id``) the holders' bitset
# (index ordinals), the soonest expiry among them, the ordinal generation the two
# were computed in (STALE: recompute), when a lookup last recomputed them (-inf:
# never; every worker added since has its bit) and how many hashes share the entry.
# Only strings as keys (CPython's faster lookup) and ints, floats and strings as
# values: the garbage collector does not track such a dict, and a busy gateway holds
# hundreds of thousands (as lists they made its collections cost 10 % more CPU).
BITS, SOONEST, GENERATION, COMPUTED = " bits", " soonest", " generation", " computed"
REFS, HOLD = " refs", " hold"
META = 6  # keys of an entry that are not workers
STALE = -1


class Speculation:
    """hash -> entry (see above), plus a heap of (expiry, hold number) and each live
    hold's (worker, hashes), to expire them.

    The hashes one hold found unclaimed share one entry (``REFS`` counts them). A
    later hold that covers every hash sharing an entry changes it once for all; one
    that covers only some gives each of those its own copy first (copy on write), as
    a withdrawal does, so an entry always says exactly who holds each of its hashes.
    An entry emptied by an expiry through some of its hashes is let go by the others
    when the hold that set that expiry (which covered them all) expires too.
    """

    def __init__(self) -> None:
        self.by_hash: dict[int, dict[str, Any]] = {}
        self._heap: list[tuple[float, int]] = []  # (expiry, hold number)
        # hold number -> (worker, hashes), until it expires or a later hold supersedes it
        self._holds: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._held = 0  # hashes in those
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
        if len(set(hashes)) != len(hashes):
            # A chain never repeats a hash; counting a repeat twice would take an entry
            # shared with a hash not held for all of it (8 us for 375 hashes).
            hashes = list(dict.fromkeys(hashes))
        expiry = now + ttl
        by_hash = self.by_hash
        new: dict[str, Any] | None = None  # the entry the unclaimed hashes share
        fresh = 0
        added = 0
        # Shared entries met, with how many of ``hashes`` point at each (runs of the
        # same entry are counted without a dict operation: a chain's hashes come in runs).
        met: dict[int, list[Any]] = {}
        run: dict[str, Any] | None = None
        run_n = 0
        for h in hashes:
            e = by_hash.get(h)
            if e is None:
                if new is None:
                    new = {
                        BITS: bit,
                        SOONEST: expiry,
                        GENERATION: generation,
                        COMPUTED: -INF,
                        REFS: 0,
                        HOLD: self.added + 1,
                        worker_id: expiry,
                    }
                by_hash[h] = new
                fresh += 1
            elif e is new:
                continue
            elif e[REFS] == 1:
                added += _hold(e, worker_id, expiry, bit, generation)
            elif e is run:
                run_n += 1
            else:
                if run is not None:
                    _count(met, run, run_n)
                run, run_n = e, 1
        if run is not None:
            _count(met, run, run_n)
        partly: set[int] = set()
        for e, n in met.values():
            if n == e[REFS]:  # every hash sharing it is held: one change for all
                added += n * _hold(e, worker_id, expiry, bit, generation)
                self._supersede(e, worker_id)
            else:
                partly.add(id(e))
        if partly:  # entries only some of whose hashes are held: those get own copies
            for h in hashes:
                e = by_hash[h]
                if id(e) in partly:
                    mine = by_hash[h] = _own_copy(e)
                    added += _hold(mine, worker_id, expiry, bit, generation)
        if new is not None:
            new[REFS] = fresh
        self.pairs += added + fresh
        self.added += 1
        self._holds[self.added] = (worker_id, tuple(hashes))
        self._held += len(hashes)
        heapq.heappush(self._heap, (expiry, self.added))

    def _supersede(self, e: dict[str, Any], worker_id: str) -> None:
        """Forgets the hold that made entry ``e`` when ``worker_id``'s hold, which covers
        every hash of ``e``, covers all of that hold's too: whatever expiry it set is
        overwritten, so its expiry would find nothing to drop. A request's hold while it
        waits for its first token (up to a minute) is superseded at its first token by
        the short grace: its hashes are not kept for a minute after that grace expired.
        """
        made = self._holds.get(e[HOLD])
        if made is not None and made[0] == worker_id and len(made[1]) == e[REFS]:
            del self._holds[e[HOLD]]
            self._held -= len(made[1])

    def withdraw(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Forgets ``worker_id``'s entries for ``hashes`` at once (their heap items stay)."""
        by_hash = self.by_hash
        for h in hashes:
            e = by_hash.get(h)
            if e is None or worker_id not in e:
                continue
            if e[REFS] > 1:  # withdrawals are rare (failed requests): a copy per hash is fine
                e = by_hash[h] = _own_copy(e)
            del e[worker_id]
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
            made = self._holds.pop(heapq.heappop(heap)[1], None)
            if made is None:  # superseded
                continue
            w, hashes = made
            self._held -= len(hashes)
            for h in hashes:
                e = by_hash.get(h)
                if e is None:
                    continue
                exp = e.get(w)
                if exp is not None and exp <= now:
                    # The bitset may keep w's bit: SOONEST is at most w's expiry, so no
                    # lookup from now on takes the cached bitset without recomputing.
                    del e[w]
                    gone += e[REFS]
                # An entry shared with other hashes may have been emptied through one
                # of them already: each of its hashes lets go of it here.
                if len(e) == META:
                    del by_hash[h]
                    e[REFS] -= 1
        self.pairs -= gone
        return gone

    def drop_worker(self, worker_id: str) -> None:
        """Forgets every entry of ``worker_id`` (its heap items stay until they expire)."""
        for w, hashes in self._holds.values():
            if w == worker_id:
                self.withdraw(worker_id, hashes)

    def nbytes(self) -> int:
        """Estimated memory of the entries and the heap."""
        return len(self.by_hash) * 380 + len(self._heap) * 80 + self._held * 8


def _hold(e: dict[str, Any], worker_id: str, expiry: float, bit: int, generation: int) -> int:
    """Sets ``worker_id``'s expiry in entry ``e``; 1 when the worker is new to it."""
    was = e.get(worker_id)
    e[worker_id] = expiry
    if was is not None and was > e[COMPUTED]:
        # A renewal of an entry live at the last recompute (or added since):
        # its bit is in BITS already; only a shorter hold moves SOONEST.
        if expiry < e[SOONEST]:
            e[SOONEST] = expiry
        return 0
    if e[GENERATION] == generation:
        e[BITS] |= bit
        if expiry < e[SOONEST]:
            e[SOONEST] = expiry
    return 1 if was is None else 0


def _count(met: dict[int, list[Any]], e: dict[str, Any], n: int) -> None:
    """Adds a run of ``n`` hashes that share entry ``e`` to ``met``."""
    seen = met.get(id(e))
    if seen is None:
        met[id(e)] = [e, n]
    else:
        seen[1] += n


def _own_copy(e: dict[str, Any]) -> dict[str, Any]:
    """A copy of shared entry ``e`` for one of its hashes (which then stops sharing ``e``)."""
    e[REFS] -= 1
    mine = dict(e)
    mine[REFS] = 1
    return mine
