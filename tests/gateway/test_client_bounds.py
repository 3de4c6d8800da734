"""What a client controls cannot grow the gateway (issue 14): session keys are hashed to a
fixed size, an over-long X-Session-ID is a 400, and a prompt the context refuses never
fills the prefix-token cache."""

from __future__ import annotations

import gc
import tracemalloc

from tests.gateway.conftest import MakeGateway

HUGE_USER = "u" * 1_000_000  # 1 MB: well inside the 4 MB body limit
REQUESTS = 40


async def test_huge_user_fields_cost_a_fixed_size_each(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await gateway.add_worker("a")

    async def send(first: int, count: int) -> int:
        for n in range(first, first + count):
            body = [{"role": "user", "content": f"hi {n}"}]
            resp = await gateway.chat(body, user=f"{n}{HUGE_USER}")
            assert resp.status == 200, await resp.text()
            resp.release()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    await send(0, 2)  # first-use allocations
    tracemalloc.start()
    try:
        # aiohttp keeps the last request's body bytes until the next one arrives: one 1 MB
        # body is always held, so compare 10 requests with 10 + REQUESTS rather than with 0.
        after_ten = await send(2, 10)
        after_all = await send(12, REQUESTS)
    finally:
        tracemalloc.stop()
    sessions = gateway.state.sessions
    assert len(sessions) == REQUESTS + 12
    assert {len(k) for k in sessions._entries} == {32}  # blake2b-128, hex
    # Raw keys would add 40 MB; hashed, each session is ~200 B of map entry (plus the
    # prefix cache of 40 short prompts): far below one raw key.
    grown = after_all - after_ten
    assert grown < 500_000, f"{grown} bytes kept by {REQUESTS} more 1 MB session keys"


async def test_an_over_long_session_header_is_a_400(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await gateway.add_worker("a")
    ok = await gateway.chat(
        [{"role": "user", "content": "hi"}], headers={"X-Session-ID": "s" * 256}
    )
    assert ok.status == 200
    resp = await gateway.chat(
        [{"role": "user", "content": "hi"}], headers={"X-Session-ID": "s" * 257}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "X-Session-ID" and "256" in error["message"]
    assert len(gateway.state.sessions) == 1  # the refused one left no session behind


async def test_a_refused_prompt_never_fills_the_prefix_cache(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await gateway.add_worker("a", max_model_len=256)
    cache = gateway.state.tokenizer.prefix_cache
    assert cache is not None
    fits = [{"role": "user", "content": "a short question about caching"}]
    assert (await gateway.chat(fits)).status == 200
    remembered = len(cache), cache.cached_tokens
    too_long = [{"role": "user", "content": "a long document sentence " * 120}]  # ~600 tokens
    resp = await gateway.chat(too_long)
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["code"] == "context_length_exceeded"
    assert (len(cache), cache.cached_tokens) == remembered
