"""The gateway's own ``Dispatcher`` over a synthetic fleet, for ``loadtest.bench_scale``.

Every worker registered, healthy and loaded with the same hash spec; a job
whose block chain is given (the fleet's hashes are synthetic, not token ids),
so the benchmark times the production routing steps and nothing else.
"""

from __future__ import annotations

import time
from typing import Any

from contract.hashing import HashSpec
from contract.redis_layout import WorkerRecord
from gateway.edge.auth import Tenant
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.window_stats import RollingStats
from gateway.routing.dispatch import Dispatcher
from gateway.routing.index import BlockIndex
from gateway.routing.jobs import Job
from gateway.routing.mirror_state import WorkerEntry
from gateway.routing.router import Router, RouterConfig
from gateway.routing.sessions import SessionMap
from gateway.upstream.base import Generation

BLOCK_SIZE = 16


class ChainPrompt:
    """A prompt whose block chain is given (the fleet's hashes are synthetic, not token ids)."""

    def __init__(self, chain: list[int]) -> None:
        self.chain = chain
        self.ids = [0] * (len(chain) * BLOCK_SIZE)

    def block_hashes(self, spec: HashSpec) -> list[int]:
        return self.chain


def fleet_dispatcher(index: BlockIndex, ids: list[str], loads: dict[str, int]) -> Dispatcher:
    """The gateway's own Dispatcher over ``index``, every worker registered and healthy."""
    spec = HashSpec(block_size=BLOCK_SIZE, model="bench")
    now = time.time()
    workers = {
        w: WorkerEntry(
            record=WorkerRecord(
                worker_id=w,
                address="127.0.0.1:1",
                model="bench",
                num_blocks=200_000,
                max_model_len=32_768,
                running=loads[w],
                queued_prefill_tokens=loads[w] * 512,
                prefill_tokens_per_s=8000.0,
                updated_at=now,
            ),
            spec=spec,
            loaded=True,
        )
        for w in ids
    }
    mirror: Any = type(
        "Mirror", (), {"workers": workers, "changes": 0, "no_worker_hint": lambda self: ""}
    )()
    return standalone_dispatcher(mirror, index)


def standalone_dispatcher(mirror: Any, index: BlockIndex, **overrides: Any) -> Dispatcher:
    """A ``Dispatcher`` with no app around it (benchmarks, tests): defaults, then ``overrides``."""
    parts: dict[str, Any] = {
        "router": Router(RouterConfig()),
        "upstreams": {},
        "sessions": SessionMap(60.0),
        "metrics": GatewayMetrics(),
        "stats": RollingStats(),
        "speculative_ttl_s": 2.0,
        "max_queue_per_worker": 0,
        "request_timeout_s": 60.0,
        "max_retries": 2,
    }
    return Dispatcher(mirror=mirror, index=index, **{**parts, **overrides})


def greedy_generation(request_id: str, prompt_ids: list[int], max_tokens: int = 16) -> Generation:
    """A plain greedy request for routing benchmarks (routing reads only its sizes)."""
    return Generation(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        ignore_eos=False,
        stop_token_ids=(),
        cache_salt="",
    )


def chain_job(chain: list[int]) -> Job:
    prompt: Any = ChainPrompt(chain)
    generation = greedy_generation("bench", prompt.ids)
    return Job("bench", prompt, generation, Tenant(), session_key=None, started=0.0)
