"""The index mirror's rule for a whole fleet vanishing from the registry at once.

One worker's registry key expiring is that worker dying. Every listed worker's
key vanishing in the same poll, while the directory still lists them all, looks
like Redis trouble instead (a full ``noeviction`` Redis refusing every
heartbeat's ``HSET`` until the TTLs run out). ``FleetLossHold`` keeps that last
fleet routable for ``grace_s``, logs it once and shows it in
``kvroute_gateway_registry_held_workers`` and
``kvroute_gateway_registry_fleet_vanished_total``; a worker that deregistered
(left the directory) is dropped at once all the same.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

# The mirror's log: its lines keep the one logger name whichever module writes them.
logger = logging.getLogger("gateway.routing.mirror")

# A vanished fleet is kept this long: several heartbeat TTLs (default 3 s), long
# enough for a Redis that refused writes for a moment to take them again, short
# enough that a fleet that really died stops being routed to soon.
FLEET_LOSS_GRACE_S = 15.0


class FleetLossHold:
    """Decides which workers whose registry key is missing stay, as a vanished fleet."""

    def __init__(self, grace_s: float, registry: CollectorRegistry) -> None:
        self.grace_s = grace_s
        self._lost_at: float | None = None  # when the held fleet vanished
        self.vanished = Counter(
            "kvroute_gateway_registry_fleet_vanished",
            "Times every worker's registry key vanished at once (kept as Redis trouble)",
            registry=registry,
        )
        self.held_workers = Gauge(
            "kvroute_gateway_registry_held_workers",
            "Workers kept in routing although their registry key vanished (Redis trouble)",
            registry=registry,
        )

    def held(self, missing: list[str], live: set[str], listed: set[str]) -> set[str]:
        """The workers whose key is missing but that stay, as part of a vanished fleet.

        Holding starts when two or more workers, all still in the directory, lose
        their keys in the same poll with none left live (one key expiring is that
        worker's death); it ends when any worker is live again, when they leave
        the directory (deregistered) or after ``grace_s``.
        """
        vanished = {w for w in missing if w in listed}
        if live or not vanished:
            self.end("a worker is live again" if live else "the workers deregistered")
            return set()
        now = time.monotonic()
        if self._lost_at is None:
            if len(vanished) < 2 or len(vanished) != len(missing):
                return set()
            self._lost_at = now
            self.vanished.inc()
            logger.warning(
                "every worker's registry key vanished at once (%d workers): treating it as "
                "Redis trouble (full or flushed?) and keeping the last known fleet for %.0f s",
                len(vanished),
                self.grace_s,
            )
        elif now - self._lost_at >= self.grace_s:
            self.end(f"no registry key came back within {self.grace_s:.0f} s")
            return set()
        self.held_workers.set(len(vanished))
        return vanished

    def end(self, why: str) -> None:
        """Stops holding a vanished fleet (nothing when none is held)."""
        if self._lost_at is None:
            return
        self._lost_at = None
        self.held_workers.set(0)
        logger.warning("registry: no longer holding the vanished fleet (%s)", why)
