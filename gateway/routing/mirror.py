"""Keeps the gateway's ``BlockIndex`` and worker list in step with Redis.

Four duties, all on the event loop, none of which waits on another:

1. Discovery (``gateway.routing.mirror_registry``): every ``poll_s`` read the
   directory and every registry hash in one pipelined round trip. A missing
   key is a dead worker: it and all its blocks leave the index. A new worker
   (or a new epoch) is queued for a load.
2. Load (its own task, ``gateway.routing.mirror_streams``): for up to
   ``_LOAD_BATCH`` queued workers per round trip, read each stream's last entry
   and *then* its block set, staged into the index between awaits and swapped
   in at once: a 100k-block reload never stalls the loop, and lookups keep the
   old blocks until the new ones are complete.
3. Tail (``gateway.routing.mirror_streams``): ``XREAD BLOCK`` every loaded
   worker's stream from its last id and apply the batches. A new epoch or a
   ``seq`` gap queues that worker for a reload; the others' tail goes on.
4. Upkeep: expire speculative entries, sweep cleared workers' old entries.

When Redis goes away the last mirror stays (routing keeps working on it). The
same holds when Redis answers but every worker's registry key vanished at once
while the directory still lists them: one worker dying looks like that, a whole
fleet dying in the same poll looks like Redis trouble. The mirror keeps that
last fleet for ``fleet_loss_grace_s`` (``gateway.routing.mirror_fleet_loss``).
On reconnect nothing is reloaded blindly: one pipelined read of every stream's
last id tells which workers' streams went back (a Redis that lost its data);
only those reload, the others resume their tail and their ``seq`` decides.

On Redis Cluster (``cluster=True``) streams live in different slots, so the
tail becomes a pipelined non-blocking ``XREAD`` per worker every
``_CLUSTER_TAIL_S``. What the mirror knows (``WorkerEntry``, the worker table)
is in ``gateway.routing.mirror_state``; this module runs the duties and
survives Redis outages.

A front process of a multi-process gateway (``gateway.routing.index_share``)
runs discovery only (``blocks=False``): its process's owner holds the blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from contract.redis_url import redact
from gateway.routing.mirror_registry import RegistrySync
from gateway.routing.mirror_state import raise_if_cancelled
from gateway.routing.mirror_streams import StreamSync

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0
_UNREACHABLE_LOG_S = 3.0  # at most one "cannot reach redis" line per this many seconds
_PRUNE_SLICE = 20_000  # speculative entries expired between yields (~8 ms)


class IndexMirror(RegistrySync, StreamSync):
    """The Redis side of the gateway: registry, block sets, event streams.

    Built with ``MirrorState``'s arguments (``redis_url``, ``layout``, ``index``, options).
    """

    def _client(self) -> Any:
        opts: dict[str, Any] = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}
        if self.cluster:
            return RedisCluster.from_url(self.redis_url, **opts)
        return aioredis.Redis.from_url(self.redis_url, **opts)

    # -- lifecycle ---------------------------------------------------------------

    def no_worker_hint(self) -> str:
        """Why there may be no worker to route to, in words for a 503 body."""
        url = redact(self.redis_url)
        if not self.redis_ok and not self.has_snapshot:
            return f"this gateway cannot reach Redis at {url} ({self.last_error}); retrying"
        if not self.redis_ok:
            return f"Redis at {url} is unreachable ({self.last_error}); retrying"
        return (
            f"no worker is registered in Redis {url} under namespace "
            f"'{self.layout.namespace}' (workers need the same --redis-url and --redis-namespace)"
        )

    async def run(self) -> None:
        """Mirrors Redis until cancelled, surviving Redis outages."""
        backoff = 0.1
        while True:
            client = self._client()
            try:
                await client.ping()
                if not self.redis_ok:
                    logger.info("connected to redis %s", redact(self.redis_url))
                    if self.has_snapshot:
                        self._connected_at = time.monotonic()
                self.redis_ok = True
                backoff = 0.1
                if self.has_snapshot and self.blocks:
                    await self.revalidate(client)
                await self.sync_registry(client)
                if self.blocks:
                    await self.load_pending(client)
                self.has_snapshot = True
                raise_if_cancelled()
                await self._follow(client)
            except (RedisError, OSError) as exc:
                self.last_error = str(exc) or type(exc).__name__
                if self.redis_ok:
                    logger.warning("redis unavailable (%s); serving from the last mirror", exc)
                elif time.monotonic() >= self._next_unreachable_log:
                    # Never reached (or still down): a line every few seconds, not silence.
                    logger.warning(
                        "cannot reach redis %s (%s); retrying", redact(self.redis_url), exc
                    )
                    self._next_unreachable_log = time.monotonic() + _UNREACHABLE_LOG_S
                self.redis_ok = False
                self.reconnects += 1
            except Exception:
                # A bug must not stop the mirror for good: log it, reconnect, reload.
                logger.exception("index mirror failed; restarting it")
                self.redis_ok = False
                self.reconnects += 1
                for wid in self.workers:
                    self._queue_load(wid)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
            raise_if_cancelled()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _follow(self, client: Any) -> None:
        """Polls the registry, loads and tails until one of them fails.

        Plain tasks rather than a TaskGroup: on Python 3.11 a TaskGroup whose
        child fails leaves its parent marked as cancelled, which would stop the
        reconnect loop for good.
        """
        tail = self._cluster_tail_loop if self.cluster else self._tail_loop
        tasks = {asyncio.create_task(self._poll_loop(client))}
        if self.blocks:
            tasks.add(asyncio.create_task(self._load_loop(client)))
            tasks.add(asyncio.create_task(tail(client)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        for task in done:
            task.result()  # raises the failure that ended the wait

    # -- discovery and upkeep ----------------------------------------------------

    async def _poll_loop(self, client: Any) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.sync_registry(client)
            now = time.monotonic()
            while self.index.prune(now, limit=_PRUNE_SLICE) >= _PRUNE_SLICE:
                await asyncio.sleep(0)  # 1M expiring entries would hold the loop ~0.4 s
            self.index.maintain()
            raise_if_cancelled()
