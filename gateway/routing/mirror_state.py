"""What the index mirror knows, shared by its duties (``gateway.routing.mirror``).

``WorkerEntry`` is one live worker as the mirror sees it: its registry record,
hash spec, stream position and last ``seq``. ``MirrorState`` holds the worker
table, the connection status, the queue of workers waiting for a block-set load
and the loads being staged, with the two operations every duty needs: queue a
worker for a (re)load, and drop a dead one with all its blocks. The registry
side (``mirror_registry``) and the stream side (``mirror_streams``) build on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, WorkerRecord
from gateway.routing.index import BlockIndex, StagedSet
from gateway.routing.mirror_fleet_loss import FLEET_LOSS_GRACE_S, FleetLossHold

# The mirror's log: its lines keep the one logger name whichever module writes them.
logger = logging.getLogger("gateway.routing.mirror")


@dataclass
class WorkerEntry:
    """What the mirror knows about one live worker."""

    record: WorkerRecord
    spec: HashSpec | None  # None: the worker's hash spec is not one this gateway computes
    stream_id: str = "0-0"
    epoch: str = ""
    seq: int | None = None  # None: no batch seen yet, accept whatever comes next
    loaded: bool = False
    event_lag_s: float = 0.0
    loads: int = 0  # completed loads of this worker's set (tests, logs)
    heartbeat: Any = None  # the raw ``updated_at`` last parsed (unchanged: skip the parse)


def raise_if_cancelled() -> None:
    """Re-raises a cancellation that a library swallowed.

    redis-py can catch the ``CancelledError`` meant for a command and carry on;
    the task's ``cancelling()`` count still says it was cancelled, so loops
    check it and stop instead of running forever (and hanging shutdown).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class MirrorState:
    """The mirror's tables and status; ``IndexMirror`` adds the duties that fill them."""

    def __init__(
        self,
        redis_url: str,
        layout: RedisLayout,
        index: BlockIndex,
        *,
        poll_s: float = 0.5,
        reconnect_grace_s: float = 5.0,
        on_drop: Callable[[str], None] | None = None,
        cluster: bool = False,
        tokenizer_fingerprint: str = "",
        fleet_loss_grace_s: float = FLEET_LOSS_GRACE_S,
        registry: CollectorRegistry | None = None,
        blocks: bool = True,
    ) -> None:
        self.redis_url = redis_url
        self.blocks = blocks  # False: the registry only (a front process; its owner has the blocks)
        self.layout = layout
        self.index = index
        self.poll_s = poll_s
        self.cluster = cluster
        # A worker whose record names another tokenizer is never routed to ("" checks nothing).
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.refused: dict[str, str] = {}  # worker id -> epoch refused for its tokenizer
        # A Redis that just came back may be empty until every worker's
        # publisher re-registers (up to a heartbeat TTL plus its retry): a
        # missing key means "dead" only once this grace after a connect is over.
        self.reconnect_grace_s = reconnect_grace_s
        self._connected_at = float("-inf")
        # Every listed worker's key gone in one poll: Redis trouble, not deaths.
        self.fleet_loss = FleetLossHold(
            fleet_loss_grace_s, registry if registry is not None else CollectorRegistry()
        )
        self.on_drop = on_drop
        # Called with a worker's id and record when it joins (or restarts with a new epoch).
        self.on_discover: Callable[[str, WorkerRecord], None] | None = None
        self.workers: dict[str, WorkerEntry] = {}
        # Bumped whenever a worker comes, goes or gets a new record: readers that
        # derive something from every record (``Dispatcher.healthy``) redo it then.
        self.changes = 0
        self.redis_ok = False
        self.has_snapshot = False  # a full load succeeded at least once
        self.reconnects = 0
        self.last_error = ""  # why Redis was last unreachable, for logs and 503 bodies
        self._next_unreachable_log = 0.0
        self.reloads = 0  # loads of a worker that was already loaded once (gaps, epochs)
        self._pending: dict[str, None] = {}  # workers queued for a load, in order
        self._wake_loader = asyncio.Event()
        self._staged: dict[str, StagedSet] = {}

    def _queue_load(self, wid: str) -> None:
        entry = self.workers.get(wid)
        if entry is not None:
            entry.loaded = False  # the tail skips it until the load has positioned it
        self._pending[wid] = None
        self._wake_loader.set()

    def drop_worker(self, worker_id: str) -> None:
        """Forgets a dead worker and all its blocks."""
        self.workers.pop(worker_id, None)
        self.changes += 1
        self._pending.pop(worker_id, None)
        staged = self._staged.pop(worker_id, None)
        if staged is not None:
            staged.abort()
        if worker_id in self.index.workers():
            self.index.drop(worker_id)
        logger.info("worker %s gone (registry key expired); dropped from the index", worker_id)
        if self.on_drop is not None:
            self.on_drop(worker_id)
