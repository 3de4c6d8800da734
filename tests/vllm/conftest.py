"""Real vLLM CPU servers for the tests in this folder, started once per session.

Two vLLM 0.32 servers (SmolLM2, block size 32, a 96-block pool each so a few
prompts force evictions), a bridge per server, a Redis and a gateway, all real
processes (``loadtest.vllm_fleet``). ``.venv-vllm`` is built by
``.ci/vllm-venv.sh`` when missing; vLLM's compile cache in ``~/.cache/vllm``
makes a restart 70-120 s.
"""

from __future__ import annotations

import os
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import redis
import zmq

from contract.hashing import HashSpec, block_hashes
from contract.model_paths import served_model_name
from contract.redis_layout import RedisLayout, decode_block_set
from loadtest.fleet import FleetConfig
from loadtest.vllm_fleet import VLLM_BLOCK_SIZE, VllmFleet, VllmServer

NUM_BLOCKS = 96  # 95 usable: four 1,000-token prompts evict
HEARTBEAT_TTL = 2.0


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    # KVROUTE_TEST_LOG_DIR keeps every process's log after the run (pytest prunes its tmp).
    logs = os.environ.get("KVROUTE_TEST_LOG_DIR") or tmp_path_factory.mktemp("vllm-fleet-logs")
    config = FleetConfig(
        workers=2,
        heartbeat_interval=0.5,
        heartbeat_ttl=HEARTBEAT_TTL,
        log_dir=str(logs),
        startup_timeout=600.0,
    )
    with VllmFleet(config, num_blocks=NUM_BLOCKS) as f:
        yield f


@pytest.fixture(scope="session")
def rdb(fleet: VllmFleet) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(fleet.redis_url)
    yield client
    client.close()


def spec(fleet: VllmFleet) -> HashSpec:
    return HashSpec(block_size=VLLM_BLOCK_SIZE, model=served_model_name(fleet.model_dir))


def published_blocks(rdb: redis.Redis, worker_id: str, namespace: str = "kvroute") -> set[int]:
    """The block set a worker's publisher (here: its bridge) keeps in Redis."""
    return set(decode_block_set(rdb.hvals(RedisLayout(namespace).blocks(worker_id))))


def record(rdb: redis.Redis, worker_id: str, namespace: str = "kvroute") -> dict[str, str]:
    raw = rdb.hgetall(RedisLayout(namespace).worker(worker_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


def replay_log(server: VllmServer) -> list[tuple[int, list[dict[str, Any]]]]:
    """Every batch vLLM still buffers since its boot, from its replay endpoint: (seq, events)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.replay)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    try:
        while sock.poll(5000):
            _, _topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            _ts, events, *_ = msgpack.unpackb(payload, strict_map_key=False)
            out.append((int.from_bytes(seq, "big"), events))
        raise TimeoutError(f"no end of replay from {server.replay}")
    finally:
        sock.close()
        ctx.term()


def held_blocks(server: VllmServer, spec: HashSpec) -> tuple[set[int], int]:
    """(kvroute hashes of the blocks vLLM holds, removals seen), rebuilt from its event log.

    Written independently of the bridge: each vLLM block is identified by its
    full token prefix (parent's prefix + its tokens) and hashed from scratch.
    """
    prefix: dict[Any, list[int]] = {}
    copies: dict[Any, int] = {}
    removals = 0
    for _seq, events in replay_log(server):
        for e in events:
            kind = e["type"]
            if kind == "AllBlocksCleared":
                prefix.clear()
                copies.clear()
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    removals += 1
                    copies[h] -= 1
                    if copies[h] == 0:
                        del copies[h]
                        prefix.pop(h, None)
            elif kind == "BlockStored":
                parent = e["parent_block_hash"]
                tokens = list(prefix[parent]) if parent is not None else []
                bs = e["block_size"]
                for i, h in enumerate(e["block_hashes"]):
                    tokens = tokens + e["token_ids"][i * bs : (i + 1) * bs]
                    prefix[h] = tokens
                    copies[h] = copies.get(h, 0) + 1
    return {block_hashes(toks, spec)[-1] for toks in prefix.values()}, removals


_METRIC = re.compile(r"^([a-zA-Z_:]+)\{([^}]*)\}\s+([0-9.eE+-]+)$", re.M)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """Prometheus counters/gauges at ``url``/metrics as {(name, labels): value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(n, labels): float(v) for n, labels, v in _METRIC.findall(text)}


def gateway_counter(url: str, name: str, worker: str) -> float:
    """A per-worker counter of the gateway at ``url``."""
    want = re.compile(rf'(^|,)worker(_id)?="{re.escape(worker)}"')
    return sum(v for (n, labels), v in scrape(url).items() if n == name and want.search(labels))


def vllm_gauge(server: VllmServer, name: str) -> float:
    return sum(v for (n, _), v in scrape(server.url).items() if n == name)
