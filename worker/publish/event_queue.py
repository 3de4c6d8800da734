"""KV events on their way from the engine thread to the publisher.

``EventQueue`` is the hand-off: the engine thread ``put``s each step's events
and never blocks (a full queue drops them and raises the overflow flag, which
the publisher answers with a full snapshot); the publisher drains it on its
event loop. ``net_effect`` says what a drained run of events does to the
worker's block set, so one transaction replays the whole run.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class EventQueue:
    """Bounded, lock-free hand-off of KV events from the engine thread to the publisher.

    ``put`` runs on the engine thread and never blocks: when the queue is full it
    drops the events and raises the overflow flag, and the publisher answers with
    a full snapshot instead of the lost deltas.
    """

    def __init__(self, maxsize: int = 10_000) -> None:
        if maxsize <= 0:
            raise ValueError("event queue size must be positive")
        self._items: deque[tuple[KVEvent, ...]] = deque()
        self._maxsize = maxsize
        self._overflow = threading.Event()
        self._notify: Callable[[], None] | None = None

    def put(self, events: Sequence[KVEvent]) -> None:
        """Engine-thread callback (``Engine(on_events=queue.put)``)."""
        if not events:
            return
        if len(self._items) >= self._maxsize:
            self._overflow.set()
        else:
            self._items.append(tuple(events))
        notify = self._notify
        if notify is not None:
            notify()

    def set_notify(self, notify: Callable[[], None] | None) -> None:
        """Called (from the engine thread) after each put; must not block."""
        self._notify = notify

    def drain(self, max_events: int) -> list[KVEvent]:
        """Removes and returns queued events in order, stopping after ``max_events``."""
        out: list[KVEvent] = []
        while self._items and len(out) < max_events:
            out.extend(self._items.popleft())
        return out

    def discard(self) -> None:
        """Drops everything queued (a snapshot is about to supersede it)."""
        while self._items:
            self._items.popleft()

    def take_overflow(self) -> bool:
        """True once after events were dropped."""
        if self._overflow.is_set():
            self._overflow.clear()
            return True
        return False

    def __len__(self) -> int:
        return len(self._items)


def net_effect(events: Iterable[KVEvent]) -> tuple[bool, set[int], set[int]]:
    """(cleared, added, removed): what a run of events does to the block set.

    The last event touching a hash wins, so one SADD and one SREM replay a whole
    batch; ``cleared`` means the set must be emptied first.
    """
    cleared = False
    state: dict[int, bool] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cleared = True
            state.clear()
        elif isinstance(event, BlockStored):
            state.update(dict.fromkeys(event.block_hashes, True))
        elif isinstance(event, BlockRemoved):
            state.update(dict.fromkeys(event.block_hashes, False))
    added = {h for h, present in state.items() if present}
    removed = set() if cleared else {h for h, present in state.items() if not present}
    return cleared, added, removed
