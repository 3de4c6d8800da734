"""What one gateway app holds, reachable from handlers through typed ``web.AppKey``s."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.edge.auth import ApiKeys, Tenant
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.window_stats import RollingStats
from gateway.routing.dispatch import Dispatcher
from gateway.routing.index import BlockIndex
from gateway.routing.index_share import IndexServer, RemoteIndex
from gateway.routing.mirror import IndexMirror
from gateway.routing.sessions import SessionMap
from gateway.text.tokenizer import ChatTokenizer


@dataclass
class GatewayState:
    """The gateway's long-lived parts, built once by ``create_app``."""

    config: GatewayConfig
    tokenizer: ChatTokenizer
    index: BlockIndex
    mirror: IndexMirror
    sessions: SessionMap
    metrics: GatewayMetrics
    stats: RollingStats
    dispatcher: Dispatcher
    api_keys: ApiKeys | None
    started_at: int
    # A multi-process gateway's index link: the owner's server, or a front's client.
    pod: IndexServer | RemoteIndex | None = None
    owner_lost: asyncio.Event = field(default_factory=asyncio.Event)  # a front's owner went away
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs ``coro`` as a task the app keeps a reference to until it is done."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def ready(self) -> bool:
        """Has Redis or a mirror loaded from it, and at least one healthy worker."""
        return (self.mirror.redis_ok or self.mirror.has_snapshot) and bool(
            self.dispatcher.healthy()
        )


STATE = web.AppKey("state", GatewayState)
TENANT = web.RequestKey("tenant", Tenant)  # set by the auth middleware
__all__ = ["STATE", "TENANT", "GatewayState", "Tenant"]
