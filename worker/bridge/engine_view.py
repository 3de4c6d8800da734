"""The engine as the bridge's ``Publisher`` sees it: the chain map's blocks and the last load.

The publisher a kvroute worker runs reads ``stats()`` and
``resident_block_hashes()`` from its engine; ``EngineView`` answers both for
an engine the bridge follows from outside, from the ``ChainMap`` and the
latest ``/metrics`` scrape (``stats_from_load``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.bridge.chain_map import ChainMap
from worker.bridge.engine_http import EngineLoad, RateMeter


@dataclass
class BridgeStats:
    """The ``EngineView.stats()`` shape the publisher reads for each heartbeat."""

    num_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclass
class EngineView:
    """The engine as the publisher sees it: the chain map's set and the last scrape."""

    chain: ChainMap
    load: BridgeStats = field(default_factory=BridgeStats)

    def stats(self) -> BridgeStats:
        return self.load

    def resident_block_hashes(self) -> set[int]:
        return self.chain.resident_block_hashes()


def stats_from_load(load: EngineLoad, num_blocks: int, rates: RateMeter) -> BridgeStats:
    """One scrape as publisher stats; ``num_blocks`` stands in when the scrape lacks it."""
    blocks = load.num_blocks or num_blocks
    return BridgeStats(
        num_blocks=blocks,
        running=load.running,
        waiting=load.waiting,
        free_blocks=load.free_blocks if load.num_blocks else blocks,
        prefill_tokens_per_s=rates.prefill_tokens_per_s,
        decode_tokens_per_s=rates.decode_tokens_per_s,
    )
