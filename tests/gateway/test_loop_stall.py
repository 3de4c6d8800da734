"""Maximal request bodies never stall the gateway's event loop.

The gateway runs in this test's loop (aiohttp's test server), so a probe that
sleeps 2 ms in a loop measures every stall directly. Two bodies: the largest the
gateway accepts (4 MB of 4,096 chat messages), refused by size before it is
rendered, and the largest chat it does render and tokenize (just under the
context times ``MAX_CHARS_PER_TOKEN`` characters), whose rendering and encoding
run off the loop. Measured here (2 cores shared with a busy suite, load ~40):
worst stall 50-130 ms, against 180 ms for rendering alone and seconds for encoding
if they ran on the loop; the bound is 250 ms so the test holds on a loaded box and
still fails if tokenizing ran on the loop again.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time

from gateway.request_path import MAX_CHARS_PER_TOKEN
from openai_api.messages import MAX_MESSAGES
from tests.gateway.conftest import MODEL, MakeGateway

STALL_LIMIT_S = 0.25


def _chat(total_chars: int) -> bytes:
    per = total_chars // MAX_MESSAGES
    messages = [{"role": "user", "content": "word " * (per // 5)}] * MAX_MESSAGES
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()


async def test_maximal_bodies_do_not_stall_the_loop(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await gateway.add_worker("a")
    gc.collect()
    gc.freeze()  # as ``kvroute gateway`` does once it is up: start-up objects leave the GC
    limit = gateway.state.config.max_body_bytes
    largest = _chat(limit - 300_000)
    assert limit * 0.9 < len(largest) <= limit
    rendered = _chat(gateway.state.tokenizer.max_model_len * MAX_CHARS_PER_TOKEN - 5_000)

    worst = 0.0
    done = asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            worst = max(worst, time.perf_counter() - t - 0.002)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    for raw in (largest, rendered):
        resp = await gateway.client.post(
            "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 400, await resp.text()  # past the context either way
        assert (await resp.json())["error"]["code"] == "context_length_exceeded"
    done.set()
    await task
    assert worst < STALL_LIMIT_S, f"the loop stalled {worst * 1000:.1f} ms"
