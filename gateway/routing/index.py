"""The gateway's in-memory block index: which worker holds which block hash.

A mirror of every worker's Redis block set (``gateway.routing.mirror`` keeps it
current), plus *speculative* entries: right after a request is routed to a
worker, that worker is assumed to hold the request's blocks for a few
seconds, so a burst of siblings stays together before the real events land.

An inverted map ``hash -> workers`` makes a lookup a walk of the request's
chain that stops at the first block nobody holds: O(blocks), no I/O.
Not thread-safe: it lives on the gateway's event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class BlockIndex:
    """Block hashes per worker, real and speculative."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        # hash -> {worker: monotonic expiry}
        self._speculative: dict[int, dict[str, float]] = {}

    # -- real entries (from Redis) ---------------------------------------------

    def add(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Records that ``worker_id`` now holds ``hashes`` (idempotent)."""
        mine = self._blocks.setdefault(worker_id, set())
        for h in hashes:
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Records that ``worker_id`` evicted ``hashes`` (unknown hashes are ignored)."""
        mine = self._blocks.get(worker_id)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                holders = self._holders[h]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]

    def clear(self, worker_id: str) -> None:
        """Forgets every real block of ``worker_id`` (it stays known, holding nothing)."""
        self.remove(worker_id, list(self._blocks.get(worker_id, ())))
        self._blocks[worker_id] = set()

    def replace(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Sets ``worker_id``'s blocks to exactly ``hashes`` (a reload from its Redis set)."""
        new = set(hashes)
        old = self._blocks.get(worker_id, set())
        self.remove(worker_id, old - new)
        self.add(worker_id, new - old)

    def drop(self, worker_id: str) -> None:
        """Forgets ``worker_id`` entirely, speculative entries included (it died)."""
        self.clear(worker_id)
        del self._blocks[worker_id]
        for h in [h for h, ws in self._speculative.items() if worker_id in ws]:
            ws = self._speculative[h]
            del ws[worker_id]
            if not ws:
                del self._speculative[h]

    # -- speculative entries -----------------------------------------------------

    def speculate(self, worker_id: str, hashes: Sequence[int], now: float, ttl: float) -> None:
        """Assumes ``worker_id`` holds ``hashes`` until ``now + ttl`` (monotonic seconds)."""
        if ttl <= 0:
            return
        expiry = now + ttl
        for h in hashes:
            self._speculative.setdefault(h, {})[worker_id] = expiry

    def prune(self, now: float) -> int:
        """Drops expired speculative entries; returns how many went."""
        gone = 0
        for h in list(self._speculative):
            ws = self._speculative[h]
            for w in [w for w, exp in ws.items() if exp <= now]:
                del ws[w]
                gone += 1
            if not ws:
                del self._speculative[h]
        return gone

    # -- queries -----------------------------------------------------------------

    def longest_prefix(self, hashes: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Per worker, how many blocks of the chain ``hashes`` it holds from block 0.

        Workers holding none are absent. Speculative entries count only when
        ``now`` (monotonic seconds) is given and they have not expired.
        """
        result: dict[str, int] = {}
        alive: set[str] = set()
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, set())
            spec = self._speculative.get(h)
            if spec and now is not None:
                holders = holders | {w for w, exp in spec.items() if exp > now}
            still = set(holders) if i == 0 else alive & holders
            for w in alive - still:
                result[w] = i
            alive = still
            if not alive:
                return result
        for w in alive:
            result[w] = len(hashes)
        return result

    def block_count(self, worker_id: str) -> int:
        """Real blocks the index believes ``worker_id`` holds."""
        return len(self._blocks.get(worker_id, ()))

    def holds(self, worker_id: str, block_hash: int) -> bool:
        return block_hash in self._blocks.get(worker_id, ())

    def workers(self) -> list[str]:
        return sorted(self._blocks)

    def speculative_count(self) -> int:
        return sum(len(ws) for ws in self._speculative.values())
