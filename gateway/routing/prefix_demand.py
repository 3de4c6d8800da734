"""How many requests lately wanted the same cached prefix: what a duplicate of it is worth.

The router charges sending a request away from the worker that holds its
longest cached prefix (the duplicate recomputes it and takes cache room
elsewhere). That charge is right for a prefix one conversation owns: the
duplicate serves that conversation once. A prefix many requests share — a
system prompt every new user sends, a hot document — is different: once a
second worker holds it, every later request can go to either, so the
duplicate's cost is spread over all of them. ``PrefixDemand`` counts, per
block hash (the deepest block the fleet holds of a request's chain), the
requests that wanted it, decayed with a time constant, so the router can
divide the charge by the demand (``gateway.routing.router``, step 3).

Bounded: past ``max_keys`` the least recently wanted prefixes are forgotten
(a forgotten prefix counts as wanted by one request: the full charge).
"""

from __future__ import annotations

import math
from collections import OrderedDict

DEFAULT_TAU_S = 30.0
DEFAULT_MAX_KEYS = 100_000


class PrefixDemand:
    """Per block hash, a decayed count of the requests whose longest cached prefix ends there."""

    def __init__(self, tau_s: float = DEFAULT_TAU_S, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if not tau_s > 0:
            raise ValueError("tau_s must be positive")
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.tau_s = tau_s
        self.max_keys = max_keys
        self._counts: OrderedDict[int, tuple[float, float]] = OrderedDict()  # hash -> (count, at)

    def __len__(self) -> int:
        return len(self._counts)

    def wanted(self, block_hash: int, now: float) -> float:
        """The decayed count of earlier requests for ``block_hash`` (0.0: none), uncounted."""
        seen = self._counts.get(block_hash)
        if seen is None:
            return 0.0
        count, at = seen
        return count * math.exp(-max(now - at, 0.0) / self.tau_s)

    def observe(self, block_hash: int, now: float) -> float:
        """Counts one more request wanting ``block_hash`` at ``now``; returns the demand
        including it (1.0 for a prefix nobody wanted lately)."""
        counts = self._counts
        if block_hash in counts:
            counts.move_to_end(block_hash)
        elif len(counts) >= self.max_keys:
            counts.popitem(last=False)
        demand = 1.0 + self.wanted(block_hash, now)
        counts[block_hash] = (demand, now)
        return demand
