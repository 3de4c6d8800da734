"""Session affinity: which worker a conversation last used, forgotten after an idle TTL.

Keyed by the ``X-Session-ID`` header or the request's ``user`` field (scoped
by tenant). The router uses it to break ties and to keep a conversation on
one worker before that worker's cache events have arrived.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionMap:
    """Session key -> (worker id, last use), oldest first, bounded in size."""

    def __init__(self, ttl_s: float, max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str | None, now: float) -> str | None:
        """The worker of session ``key`` if it was used within the TTL."""
        if not key or self.ttl_s <= 0:
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry[1] > self.ttl_s:
            del self._entries[key]
            return None
        return entry[0]

    def put(self, key: str | None, worker_id: str, now: float) -> None:
        """Records that session ``key`` just used ``worker_id``."""
        if not key or self.ttl_s <= 0:
            return
        self._entries.pop(key, None)
        self._entries[key] = (worker_id, now)
        self.expire(now)

    def expire(self, now: float) -> None:
        """Drops idle sessions (the oldest are at the front) and any over the size bound."""
        while self._entries:
            key, (_, used) = next(iter(self._entries.items()))
            if now - used <= self.ttl_s and len(self._entries) <= self.max_sessions:
                break
            del self._entries[key]

    def forget_worker(self, worker_id: str) -> None:
        """Drops every session pinned to a worker that went away."""
        for key in [k for k, (w, _) in self._entries.items() if w == worker_id]:
            del self._entries[key]
