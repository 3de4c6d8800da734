"""What one gateway app holds, reachable from handlers through typed ``web.AppKey``s."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.auth import ApiKeys, Tenant
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.mirror import IndexMirror
from gateway.proxy import WorkerClients
from gateway.sessions import SessionMap
from gateway.stats import RollingStats
from gateway.tokenizer import ChatTokenizer


@dataclass
class GatewayState:
    """The gateway's long-lived parts, built once by ``create_app``."""

    config: GatewayConfig
    tokenizer: ChatTokenizer
    index: BlockIndex
    mirror: IndexMirror
    clients: WorkerClients
    sessions: SessionMap
    metrics: GatewayMetrics
    stats: RollingStats
    dispatcher: Dispatcher
    api_keys: ApiKeys | None
    started_at: int

    def ready(self) -> bool:
        """Has Redis or a mirror loaded from it, and at least one healthy worker."""
        return (self.mirror.redis_ok or self.mirror.has_snapshot) and bool(
            self.dispatcher.healthy()
        )


STATE = web.AppKey("state", GatewayState)
TENANT = "kvroute.tenant"  # request-scoped key (aiohttp request keys are plain strings)
__all__ = ["STATE", "TENANT", "GatewayState", "Tenant"]
