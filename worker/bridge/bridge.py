"""Keeps an engine worker (vLLM) in the kvroute registry, block sets and event streams.

The bridge runs next to the engine (a sidecar in its pod) and, in order:

1. subscribes to the engine's KV events before anything else, so no frame
   published from then on is missed;
2. waits for the engine's ``/health``, reads its served model, block size
   and capacity, and checks tokenizer agreement: the engine's ``/tokenize`` of
   ``contract.tokenizer_probe``'s chat must equal kvroute's own rendering, or
   the bridge refuses to register (``worker.bridge.engine_facts``);
3. starts an epoch: a fresh ``ChainMap``, rebuilt by replaying the engine's
   buffered batches from seq 0, then the worker's own ``Publisher`` (the same
   code a kvroute worker runs) announces it through an ``EngineView``;
4. follows live batches: each is translated to kvroute hashes and queued for
   the publisher; ``/metrics`` is polled every heartbeat for the load;
5. ends the epoch on an engine restart (seq reset, ``AllBlocksCleared``, a
   dropped connection, ``/health`` failing) or a seq gap the replay endpoint
   cannot fill, and starts again at 2 with a new epoch. While the engine is
   down the worker is deregistered, so it leaves routing at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from contract.redis_layout import TRANSPORT_OPENAI_HTTP, WorkerRecord
from worker.bridge.chain_map import ChainMap
from worker.bridge.engine_events import ClearedBlocks, EngineBatch
from worker.bridge.engine_facts import EngineDescriber, EngineFacts, TokenizerMismatch
from worker.bridge.engine_http import EngineHTTP, RateMeter
from worker.bridge.engine_view import BridgeStats, EngineView, stats_from_load
from worker.bridge.subscriber import EventSubscriber
from worker.publish.event_queue import EventQueue
from worker.publish.publisher import Publisher, PublisherConfig

logger = logging.getLogger(__name__)

EXIT_TOKENIZER_MISMATCH = 3


@dataclass(frozen=True)
class BridgeConfig:
    """Where the engine and Redis are, and how to announce the worker."""

    events: str  # the engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557
    url: str  # the engine's HTTP API, e.g. http://127.0.0.1:8000
    redis_url: str
    engine: str = "vllm"
    replay: str = ""  # the engine's replay endpoint; "" = none
    topic: str = ""
    worker_id: str = ""
    advertise_url: str = ""  # the URL gateways use; "" = ``url``
    namespace: str = "kvroute"
    model_name: str = ""  # the name kvroute hashes with; "" = the engine's served name
    tokenizer: str = ""  # folder of kvroute's tokenizer for the agreement check
    block_size: int = 0  # 0 = the engine's, from /metrics
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 3.0
    health_failures: int = 2  # consecutive failed polls that mean the engine is down
    replay_timeout_s: float = 2.0


@dataclass
class _EpochEnd:
    reason: str  # "stopped" | "restart" | "cleared" | "gap" | "lost"
    carry: EngineBatch | None = None  # events after an AllBlocksCleared, for the next epoch


class Bridge:
    """One engine worker's presence in the fleet, epoch after epoch."""

    def __init__(
        self, config: BridgeConfig, *, tokenizer_loader: Callable[[str], Any] | None = None
    ) -> None:
        self.config = config
        self.describer = EngineDescriber(
            block_size=config.block_size,
            model_name=config.model_name,
            tokenizer=config.tokenizer,
            tokenizer_loader=tokenizer_loader,
        )
        self.subscriber = EventSubscriber(
            config.events,
            replay_endpoint=config.replay or None,
            topic=config.topic,
            engine=config.engine,
            replay_timeout_s=config.replay_timeout_s,
        )
        self.epochs = 0  # epochs started (tests, logs)
        self.publisher: Publisher | None = None
        self.chain: ChainMap | None = None
        self._rates = RateMeter()

    # -- the whole life ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Bridges until ``stop`` is set; returns the process exit code."""
        self.subscriber.open()  # 1
        async with aiohttp.ClientSession() as session:
            http = EngineHTTP(self.config.url, session)
            carry: EngineBatch | None = None
            try:
                while not stop.is_set():
                    if not await self._wait_healthy(http, stop):  # 2
                        break
                    try:
                        facts = await self.describer.describe(http)
                    except TokenizerMismatch as exc:
                        logger.error("%s", exc)
                        return EXIT_TOKENIZER_MISMATCH
                    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                        logger.warning("engine at %s not describable yet: %s", http.url, exc)
                        await _sleep_or_stop(stop, self.config.heartbeat_interval)
                        continue
                    end = await self._epoch(http, facts, stop, carry)  # 3-4
                    carry = end.carry
                    logger.info("worker %s: epoch ended (%s)", self._worker_id(facts), end.reason)
            finally:
                await self._stop_publisher(deregister=True)
                self.subscriber.close()
        return 0

    async def _wait_healthy(self, http: EngineHTTP, stop: asyncio.Event) -> bool:
        logged = False
        while not stop.is_set():
            if await http.healthy():
                return True
            if not logged:
                logger.info("waiting for the engine at %s/health", http.url)
                logged = True
            await self.subscriber.connection_events()  # keep the monitor drained
            await _sleep_or_stop(stop, min(1.0, self.config.heartbeat_interval))
        return False

    # -- one epoch -----------------------------------------------------------------------

    async def _epoch(
        self, http: EngineHTTP, facts: EngineFacts, stop: asyncio.Event, carry: EngineBatch | None
    ) -> _EpochEnd:
        self.epochs += 1
        chain = ChainMap(facts.spec)
        self.chain = chain
        view = EngineView(chain, BridgeStats(num_blocks=facts.num_blocks))
        queue = EventQueue()
        expected: int | None = None
        replayed: dict[int, EngineBatch] = {}  # batches a live frame may repeat
        if carry is not None:  # the rest of a batch that cleared the cache
            chain.apply(carry.events)
            expected = carry.seq + 1
        else:
            expected, replayed = await self._catch_up(chain)
        await self.subscriber.connection_events()  # a reconnect before now is this epoch's
        self.publisher = Publisher(view, queue, self._publisher_config(facts), self._record(facts))
        await self.publisher.start()
        logger.info(
            "worker %s: epoch %d, %d blocks known, next seq %s",
            self._worker_id(facts),
            self.epochs,
            len(chain),
            expected,
        )
        health_failures = 0
        next_poll = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self.config.heartbeat_interval
                if await self._poll(http, view):
                    health_failures = 0
                else:
                    health_failures += 1
                    if health_failures >= self.config.health_failures:
                        await self._stop_publisher(deregister=True)
                        return _EpochEnd("lost")
            if "disconnected" in await self.subscriber.connection_events():
                await self._stop_publisher(deregister=not await http.healthy())
                return _EpochEnd("lost")
            batch = await self.subscriber.recv(timeout_s=max(0.0, next_poll - time.monotonic()))
            if batch is None:
                continue
            if expected is not None and batch.seq != expected:
                if batch.seq < expected and replayed.get(batch.seq) == batch:
                    continue  # already applied from the replay
                if batch.seq < expected:
                    await self._stop_publisher(deregister=False)
                    return _EpochEnd("restart")
                filled = await self._fill_gap(chain, queue, expected, batch)
                if filled is None:
                    await self._stop_publisher(deregister=False)
                    return _EpochEnd("gap")
                expected = filled
                continue
            replayed.clear()
            end = self._apply(chain, queue, batch)
            if end is not None:
                await self._stop_publisher(deregister=False)
                return end
            expected = batch.seq + 1
        return _EpochEnd("stopped")

    def _apply(self, chain: ChainMap, queue: EventQueue, batch: EngineBatch) -> _EpochEnd | None:
        """Translates and queues a batch; an ``AllBlocksCleared`` ends the epoch instead."""
        cut = max(
            (i for i, e in enumerate(batch.events) if isinstance(e, ClearedBlocks)), default=-1
        )
        if cut >= 0:
            rest = EngineBatch(batch.seq, batch.timestamp, batch.events[cut + 1 :])
            return _EpochEnd("cleared", carry=rest)
        queue.put(chain.apply(batch.events))
        return None

    async def _catch_up(self, chain: ChainMap) -> tuple[int | None, dict[int, EngineBatch]]:
        """Rebuilds the engine's blocks from its replay buffer (everything since its boot)."""
        replay = await self.subscriber.replay(0)
        if replay is None or not replay.batches:
            # No buffer (or nothing published yet): the first live batch is taken as it comes.
            return (0 if replay is not None and replay.complete else None), {}
        if not replay.covers(0):
            logger.warning(
                "the engine's replay buffer starts at seq %d: blocks cached before it are unknown",
                replay.batches[0].seq,
            )
        start = 0
        for i, batch in enumerate(replay.batches):
            if any(isinstance(e, ClearedBlocks) for e in batch.events):
                start = i  # nothing before the last clear matters
        for batch in replay.batches[start:]:
            chain.apply(batch.events)
        return replay.batches[-1].seq + 1, {b.seq: b for b in replay.batches}

    async def _fill_gap(
        self, chain: ChainMap, queue: EventQueue, expected: int, live: EngineBatch
    ) -> int | None:
        """Asks the replay endpoint for ``expected..live.seq``; the next seq, or None."""
        logger.warning("KV events %d..%d were missed; asking for a replay", expected, live.seq - 1)
        replay = await self.subscriber.replay(expected)
        if replay is None or not replay.batches or replay.batches[0].seq != expected:
            return None
        batches = [b for b in replay.batches if b.seq >= expected]
        if batches[-1].seq < live.seq:
            batches.append(live)
        for batch in batches:
            if self._apply(chain, queue, batch) is not None:
                return None  # a clear inside the gap: simplest to start over
        return batches[-1].seq + 1

    async def _poll(self, http: EngineHTTP, view: EngineView) -> bool:
        """``/health``, then ``/metrics`` into the registry load; False if the engine is not serving."""
        if not await http.healthy():
            return False
        try:
            load = await http.load()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.warning("engine /metrics unreadable (%s); keeping the last load", exc)
            return True
        self._rates.update(load)
        view.load = stats_from_load(load, view.load.num_blocks, self._rates)
        return True

    # -- registry --------------------------------------------------------------------

    def _worker_id(self, facts: EngineFacts) -> str:
        return self.config.worker_id or f"{self.config.engine}-{_host_port(self.config.url)}"

    def _publisher_config(self, facts: EngineFacts) -> PublisherConfig:
        return PublisherConfig(
            redis_url=self.config.redis_url,
            worker_id=self._worker_id(facts),
            namespace=self.config.namespace,
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_ttl=self.config.heartbeat_ttl,
        )

    def _record(self, facts: EngineFacts) -> WorkerRecord:
        url = (self.config.advertise_url or self.config.url).rstrip("/")
        return WorkerRecord(
            worker_id=self._worker_id(facts),
            address=url,
            model=facts.served_name,
            hash_spec=facts.spec.describe(),
            block_size=facts.spec.block_size,
            num_blocks=facts.num_blocks,
            max_model_len=facts.max_model_len,
            transport=TRANSPORT_OPENAI_HTTP,
            http_url=url,
            tokenizer_fingerprint=facts.tokenizer_fingerprint,
        )

    async def _stop_publisher(self, *, deregister: bool) -> None:
        if self.publisher is not None:
            await self.publisher.stop(deregister=deregister)
            self.publisher = None


def _host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/").replace(":", "-").replace("/", "-")


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
