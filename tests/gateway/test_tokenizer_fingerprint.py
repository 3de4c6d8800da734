"""The gateway never routes to a worker whose tokenizer fingerprint differs from its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout
from contract.tokenizer_probe import fingerprint, probe_ids
from gateway.routing.index import BlockIndex
from gateway.routing.mirror import IndexMirror
from gateway.text.fingerprint import tokenizer_fingerprint
from gateway.text.tokenizer import ChatTokenizer
from tests.gateway.fakes import FakeRegistration
from tests.gateway.helpers import eventually, namespace, running

SPEC = HashSpec(block_size=4, model="m")


async def test_mismatched_fingerprints_are_not_routed_to(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    layout = RedisLayout(namespace())
    mirror = IndexMirror(
        redis_url, layout, BlockIndex(), poll_s=0.05, tokenizer_fingerprint="tok1:ours"
    )
    same = FakeRegistration(client, layout, "same", "127.0.0.1:1", SPEC)
    other = FakeRegistration(client, layout, "other", "127.0.0.1:2", SPEC)
    old = FakeRegistration(client, layout, "old", "127.0.0.1:3", SPEC)  # record without the field
    await same.register(tokenizer_fingerprint="tok1:ours")
    await other.register(tokenizer_fingerprint="tok1:theirs")
    await old.register()
    try:
        async with running(mirror):
            await eventually(lambda: set(mirror.workers) == {"same", "old"}, what="discovery")
            await asyncio.sleep(0.3)  # several polls: it stays out
            assert "other" not in mirror.workers and mirror.refused == {"other": "epoch-1"}
            # The same worker back with the gateway's tokenizer (a new epoch) is routed to.
            await other.register(tokenizer_fingerprint="tok1:ours", epoch="epoch-2")
            await eventually(lambda: "other" in mirror.workers, what="rejoin")
            assert mirror.refused == {}
            # ...and one that switches tokenizer is dropped.
            await same.register(tokenizer_fingerprint="tok1:new", epoch="epoch-3")
            await eventually(lambda: "same" not in mirror.workers, what="drop")
    finally:
        await client.aclose()


def test_gateway_fingerprint_equals_the_contract_probe(chat_tok: ChatTokenizer) -> None:
    # What the bridge registers for a vLLM that tokenizes like kvroute (contract.probe_ids on
    # the HF tokenizer) is what this gateway computes with its own ChatTokenizer.
    assert tokenizer_fingerprint(chat_tok) == fingerprint(*probe_ids(chat_tok.tokenizer))


def test_smollm2_fingerprint_golden(smollm2: Path, chat_tok: ChatTokenizer) -> None:
    # Measured equal to vLLM 0.32's /tokenize of the same probe (docs/VLLM.md).
    assert tokenizer_fingerprint(chat_tok) == "tok1:50b831b18218286b"
