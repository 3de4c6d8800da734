"""Rolling per-worker statistics for the dashboard: the last minute of routed requests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the dashboard sees it."""

    at: float  # monotonic seconds
    worker_id: str
    reason: str
    prompt_tokens: int
    predicted_cached_tokens: int
    cached_tokens: int  # as the worker reported


class RollingStats:
    """Finished requests of the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0, max_records: int = 200_000) -> None:
        self.window_s = window_s
        self._records: deque[RequestRecord] = deque(maxlen=max_records)

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)

    def summary(self, now: float) -> dict[str, dict[str, float | int | dict[str, int]]]:
        """Per worker: requests/s, token hit rate (actual, predicted), reason mix."""
        while self._records and now - self._records[0].at > self.window_s:
            self._records.popleft()
        out: dict[str, dict[str, float | int | dict[str, int]]] = {}
        sums: dict[str, list[int]] = {}
        reasons: dict[str, dict[str, int]] = {}
        for r in self._records:
            s = sums.setdefault(r.worker_id, [0, 0, 0, 0])
            s[0] += 1
            s[1] += r.prompt_tokens
            s[2] += r.cached_tokens
            s[3] += r.predicted_cached_tokens
            mix = reasons.setdefault(r.worker_id, {})
            mix[r.reason] = mix.get(r.reason, 0) + 1
        for wid, (n, prompt, cached, predicted) in sums.items():
            out[wid] = {
                "requests": n,
                "requests_per_s": n / self.window_s,
                "prompt_tokens": prompt,
                "hit_rate": cached / prompt if prompt else 0.0,
                "predicted_hit_rate": predicted / prompt if prompt else 0.0,
                "reasons": reasons[wid],
            }
        return out
