"""The registry heartbeat, on a thread of its own with its own Redis connection.

The worker's event loop serves gRPC and HTTP and shares the GIL with the
engine thread; under CPU load it can lag for seconds, longer than the
registry TTL. This thread needs the GIL for a few milliseconds a second, so
the registry key outlives any such lag (a SIGSTOPped or dead process still
lapses, as it must).

Registry writes are apart from block-set writes: each beat is one
non-transactional pipeline of ``HSET`` (the record with current load) and
``PEXPIRE`` (registry key, block set, stream). A Redis at ``maxmemory`` with
``noeviction`` refuses the ``HSET`` but not the ``PEXPIRE``, so the key keeps
its last record and stays alive while the publisher's block-set writes fail
(inside one ``MULTI`` the refused ``HSET`` would abort the expiry too).

Two signals go back to the publisher through ``on_lost``: the ``HSET``
created the key (Redis lost this worker's state: restart, flush) or the loop
stopped ticking for ``loop_stall_s`` (then the beats stop, so the key lapses:
a worker whose loop is stuck answers no gRPC call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from contract.redis_layout import RedisLayout, WorkerRecord

logger = logging.getLogger(__name__)


class Heartbeat:
    """Refreshes one worker's registry key every ``interval`` seconds from its own thread."""

    def __init__(
        self,
        redis_url: str,
        layout: RedisLayout,
        worker_id: str,
        record: Callable[[], WorkerRecord],
        *,
        interval: float,
        ttl: float,
        op_timeout_s: float,
        loop_stall_s: float,
        on_lost: Callable[[], None],
        cluster: bool = False,
    ) -> None:
        self.redis_url = redis_url
        self.layout = layout
        self.worker_id = worker_id
        self.record = record  # called on this thread: must be a thread-safe snapshot
        self.interval = interval
        self.ttl = ttl
        self.op_timeout_s = op_timeout_s
        self.loop_stall_s = loop_stall_s
        self.on_lost = on_lost
        self.cluster = cluster
        self.beats = 0  # beats that reached Redis (tests, logs)
        self.refused = 0  # beats whose record write Redis refused (kept alive by PEXPIRE)
        self._armed = threading.Event()  # set once the publisher registered this epoch
        self._stop = threading.Event()
        self._loop_seen = time.monotonic()
        self._thread: threading.Thread | None = None
        self._trouble = ""  # the problem last logged, so each is logged once

    def start(self) -> None:
        """Starts the thread (beats begin once ``arm`` is called)."""
        self._thread = threading.Thread(
            target=self._run, name=f"kvroute-heartbeat-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def arm(self) -> None:
        """The publisher has written this epoch's record: keep it alive from now on."""
        self._armed.set()

    def loop_alive(self) -> None:
        """Called from the event loop every so often (see ``loop_stall_s``)."""
        self._loop_seen = time.monotonic()

    def stop(self) -> None:
        """Stops and joins the thread; no beat is written after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.op_timeout_s * 2 + self.interval)
            self._thread = None

    def _client(self) -> Any:
        opts: dict[str, Any] = {
            "socket_timeout": self.op_timeout_s,
            "socket_connect_timeout": self.op_timeout_s,
        }
        if self.cluster:
            return RedisCluster.from_url(self.redis_url, **opts)
        return redis.Redis.from_url(self.redis_url, **opts)

    def _run(self) -> None:
        client = self._client()
        try:
            while not self._stop.wait(self.interval):
                if not self._armed.is_set():
                    continue
                stalled = time.monotonic() - self._loop_seen
                if stalled > self.loop_stall_s:
                    self._report(
                        "loop",
                        f"event loop silent for {stalled:.0f} s; letting the registry key lapse",
                    )
                    continue
                try:
                    self.beat(client)
                except (RedisError, OSError) as exc:
                    self._report("down", f"heartbeat failed ({exc}); retrying")
        finally:
            client.close()

    def beat(self, client: Any) -> None:
        """One heartbeat: record, expiries and directory entry, each command on its own."""
        wid = self.worker_id
        key = self.layout.worker(wid)
        stale_ms = int(max(60.0, 20 * self.ttl) * 1000)
        pipe = client.pipeline(transaction=False)
        pipe.hset(key, mapping=self.record().to_mapping())
        pipe.pexpire(key, int(self.ttl * 1000))
        # The set and stream outlive a crashed worker only for a while; a live one
        # refreshes them here (an empty set has no key and needs none).
        pipe.pexpire(self.layout.blocks(wid), stale_ms)
        pipe.pexpire(self.layout.events(wid), stale_ms)
        # The directory entry is normally there already (a full Redis refuses this
        # too); it is in another Cluster slot, which a plain pipeline allows.
        pipe.sadd(self.layout.workers, wid)
        written, alive = pipe.execute(raise_on_error=False)[:2]
        if isinstance(alive, Exception):
            raise alive
        self.beats += 1
        if isinstance(written, Exception):
            # Full Redis (noeviction): the expiry still went through, the record is stale.
            self.refused += 1
            if alive:
                self._report("refused", f"registry write refused ({written}); key kept alive")
            else:
                self._report("refused-gone", f"registry write refused ({written}); key is gone")
            return
        if self._trouble:
            logger.info("worker %s: heartbeat written again", wid)
            self._trouble = ""
        if int(written) > 0:  # the HSET created the key: Redis lost this worker's state
            logger.warning("worker %s: registry key was missing; re-syncing", wid)
            self.on_lost()

    def _report(self, kind: str, text: str) -> None:
        if self._trouble != kind:
            self._trouble = kind
            logger.warning("worker %s: %s", self.worker_id, text)
