"""The gateway over real HTTP, real Redis and real gRPC, in front of fake workers."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.auth import tenant_salt
from tests.gateway.conftest import MODEL, Harness, MakeGateway, read_sse
from tests.gateway.helpers import eventually

HELLO = [{"role": "user", "content": "Say hello"}]


async def test_chat_completion_shape_ids_and_usage(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", "Hello 世界!", cached_tokens=16)
    resp = await gateway.chat(
        HELLO, temperature=0.5, top_p=0.9, seed=7, max_tokens=20, user="alice"
    )
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-kvroute-worker"] == "w1"
    assert resp.headers["x-kvroute-reason"] in ("cache", "session", "load", "fallback", "retry")
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello 世界!"}
    assert choice["finish_reason"] == "stop"
    prompt_ids = gateway.tok.encode_text(gateway.tok.render(HELLO))
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(worker.reply_ids),
        "total_tokens": len(prompt_ids) + len(worker.reply_ids),
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    sent = worker.requests[0]
    assert list(sent.prompt_token_ids) == prompt_ids
    assert sent.sampling.max_tokens == 20 and sent.sampling.seed == 7
    assert sent.sampling.temperature == pytest.approx(0.5)
    assert sent.sampling.top_p == pytest.approx(0.9)
    assert sent.cache_salt == ""


async def test_chat_stream_with_usage(gateway: Harness) -> None:
    await gateway.add_worker("w1", "one two three", cached_tokens=0)
    resp = await gateway.chat(HELLO, stream=True, stream_options={"include_usage": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["x-kvroute-worker"] == "w1"
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "one two three"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_chat_stream_without_usage_has_no_usage_field(gateway: Harness) -> None:
    await gateway.add_worker("w1", "hi")
    events = await read_sse(await gateway.chat(HELLO, stream=True))
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])


async def test_completions_plain_and_stream(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", " jumps over")
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_completion_tokens": 8}
    resp = await gateway.client.post("/v1/completions", json=body)
    assert resp.status == 200
    data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == " jumps over"
    assert list(worker.requests[0].prompt_token_ids) == gateway.tok.encode_text(
        "The quick brown fox", add_special_tokens=True
    )
    assert worker.requests[0].sampling.max_tokens == 8
    resp = await gateway.client.post(
        "/v1/completions", json={**body, "stream": True, "prompt": [504, 2365]}
    )
    events = await read_sse(resp)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " jumps over"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert list(worker.requests[1].prompt_token_ids) == [504, 2365]


async def test_models_health_ready_openapi(gateway: Harness) -> None:
    # Ready without a worker: each request gets a 503 that says why, where an unready
    # pod would leave clients a refused connection; ?workers=1 is for scripts that wait.
    await eventually(lambda: gateway.state.mirror.has_snapshot, what="index snapshot")
    resp = await gateway.client.get("/readyz")
    body = await resp.json()
    assert resp.status == 200 and body["healthy_workers"] == 0 and body["serving"] is False
    assert (await gateway.client.get("/readyz?workers=1")).status == 503
    for path in ("/health", "/healthz"):
        assert (await gateway.client.get(path)).status == 200
    resp = await gateway.chat(HELLO)
    assert resp.status == 503
    assert "no worker is registered in Redis" in (await resp.json())["error"]["message"]
    await gateway.add_worker("w1", max_model_len=1024)
    resp = await gateway.client.get("/readyz")
    assert resp.status == 200 and (await resp.json())["healthy_workers"] == 1
    models = await (await gateway.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 1024
    spec = await (await gateway.client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.")
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/healthz",
        "/readyz",
        "/metrics",
        "/dashboard",
    ):
        assert path in spec["paths"]


async def test_metrics_names(gateway: Harness) -> None:
    await gateway.add_worker("w1", cached_tokens=16)
    assert (await gateway.chat(HELLO)).status == 200
    text = await (await gateway.client.get("/metrics")).text()
    for name in (
        "kvroute_gateway_requests_total{reason=",
        "kvroute_gateway_responses_total",
        "kvroute_gateway_prompt_tokens_total",
        "kvroute_gateway_retries_total",
        "kvroute_gateway_predicted_cached_tokens_total",
        'kvroute_gateway_cached_tokens_total{worker_id="w1"} 16.0',
        'kvroute_gateway_generation_tokens_total{worker_id="w1"}',
        "kvroute_gateway_inflight_requests 0.0",
        "process_cpu_seconds_total",
        "kvroute_gateway_routing_seconds_bucket",
        "kvroute_gateway_tokenize_seconds_count 1.0",
        "kvroute_gateway_ttft_seconds_bucket",
        "kvroute_gateway_e2e_seconds_bucket",
        "kvroute_gateway_index_blocks",
        "kvroute_gateway_index_event_lag_seconds",
        "kvroute_gateway_healthy_workers 1.0",
        'kvroute_gateway_worker_inflight{worker_id="w1"} 0.0',
        'kvroute_gateway_worker_free_blocks{worker_id="w1"}',
    ):
        assert name in text, name
    # One label name for the worker, on the gateway as on the workers; no vllm:* by default.
    assert 'worker="' not in text and "kind=" not in text and "vllm:" not in text
    assert 'kvroute_gateway_responses_total{code="200"} 1.0' in text


async def test_the_access_log_times_the_prompts_tokenizing(
    gateway: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    await gateway.add_worker("w1")
    with caplog.at_level(logging.INFO, logger="kvroute.access"):
        assert (await gateway.chat(HELLO)).status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "kvroute.access"]
    assert len(lines) == 1, lines
    tokenize = float(re.search(r" tokenize=([0-9.]+)s ", lines[0]).group(1))  # type: ignore[union-attr]
    total = float(re.search(r" time=([0-9.]+)s$", lines[0]).group(1))  # type: ignore[union-attr]
    assert 0 <= tokenize <= total


async def _tokenizer_cache_samples(gateway: Harness) -> dict[tuple[str, ...], float]:
    text = await (await gateway.client.get("/metrics")).text()
    return {
        (sample.name, *sample.labels.values()): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("kvroute_gateway_tokenizer_cache_")
        for sample in family.samples
    }


async def test_a_resent_conversation_pretokenizes_its_answer_once(
    gateway: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    await gateway.add_worker("w1", reply="Hello!")
    tok = gateway.state.tokenizer
    remembered: list[str] = []
    real = tok.remember_answer

    async def counting(messages: Any, answer: str) -> None:
        remembered.append(answer)
        await real(messages, answer)

    monkeypatch.setattr(tok, "remember_answer", counting)
    turn_2 = [*HELLO, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"}]
    for _ in range(3):  # the same conversation, the same answer: one render for its next turn
        assert (await gateway.chat(turn_2)).status == 200
    assert (await gateway.chat([*turn_2[:-1], {"role": "user", "content": "Bye"}])).status == 200
    await eventually(lambda: len(remembered) == 2, what="two distinct prompts remembered")
    await asyncio.sleep(0.1)
    assert remembered == ["Hello!", "Hello!"]


async def test_metrics_count_tokenizer_cache_reuse(gateway: Harness) -> None:
    await gateway.add_worker("w1")
    before = await _tokenizer_cache_samples(gateway)
    # Two plain prompts sharing a long text: the second reuses the first one's ids.
    story = "The quick brown fox jumps over the lazy dog by the river bank. " * 40
    for question in ("What did the fox do?", "Where was the dog?"):
        body = {"model": MODEL, "prompt": story + question, "max_tokens": 4}
        assert (await gateway.client.post("/v1/completions", json=body)).status == 200
    # A conversation's second turn reuses its first turn's rendered prefix.
    follow_up = [
        *HELLO,
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again, louder"},
    ]
    assert (await gateway.chat(HELLO)).status == 200
    assert (await gateway.chat(follow_up)).status == 200
    after = await _tokenizer_cache_samples(gateway)

    def grew(*key: str) -> float:
        return after[key] - before.get(key, 0.0)

    lookups = "kvroute_gateway_tokenizer_cache_lookups_total"
    reused = "kvroute_gateway_tokenizer_cache_reused_tokens_total"
    assert grew(lookups, "prompt", "hit") == 1 and grew(lookups, "prompt", "miss") == 1
    assert grew(reused, "prompt") > 400  # the story's ~560 tokens, up to its last cut
    assert grew(lookups, "chat", "hit") >= 1 and grew(reused, "chat") > 0
    assert after[("kvroute_gateway_tokenizer_cache_entries", "prompt")] >= 1
    assert after[("kvroute_gateway_tokenizer_cache_tokens", "chat")] > 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "messages": HELLO, "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": HELLO, "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            400,
            "messages[0].content",
        ),
        ({"model": MODEL, "messages": HELLO, "stop": [1]}, 400, "stop"),
        ({"model": MODEL, "messages": HELLO, "stream": "yes"}, 400, "stream"),
        ({"model": 5, "messages": HELLO}, 400, "model"),
        ({"model": "gpt-4", "messages": HELLO}, 404, "model"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 5000}, 400, "max_tokens"),
        ([1, 2], 400, None),
    ],
)
async def test_bad_requests_get_openai_errors(
    gateway: Harness, body: object, status: int, param: str | None
) -> None:
    await gateway.add_worker("w1")
    resp = await gateway.client.post("/v1/chat/completions", json=body)
    assert resp.status == status
    err = (await resp.json())["error"]
    assert err["param"] == param and err["message"] and err["type"]


async def test_invalid_json_big_body_unknown_route(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(max_body_bytes=4096)
    await gateway.add_worker("w1")
    resp = await gateway.client.post(
        "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"
    resp = await gateway.client.post("/v1/chat/completions", data=b"x" * 10_000)
    assert resp.status == 413 and "error" in await resp.json()
    resp = await gateway.client.get("/v1/nothing")
    assert resp.status == 404 and "error" in await resp.json()
    resp = await gateway.client.get("/v1/chat/completions")
    assert resp.status == 405 and "error" in await resp.json()


async def test_prompt_longer_than_context(gateway: Harness) -> None:
    await gateway.add_worker("w1", max_model_len=64)
    resp = await gateway.chat([{"role": "user", "content": "word " * 100}])
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "context_length_exceeded"


async def test_no_worker_is_503(gateway: Harness) -> None:
    resp = await gateway.chat(HELLO)
    assert resp.status == 503 and resp.headers["Retry-After"]
    assert (await resp.json())["error"]["code"] == "no_workers"


async def test_stop_string_cuts_text_and_aborts_worker(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker(
        "w1", "one two STOP three four five six seven", delay_s=0.02
    )
    resp = await gateway.chat(HELLO, stop=["STOP"])
    body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "one two "
    assert body["choices"][0]["finish_reason"] == "stop"
    await eventually(lambda: worker.cancelled == 1, what="worker saw the abort")
    assert worker.completed == 0


async def test_cache_routing_and_retry_on_failure(gateway: Harness) -> None:
    import grpc

    bad, bad_reg = await gateway.add_worker("a", fail=grpc.StatusCode.UNAVAILABLE)
    good, good_reg = await gateway.add_worker("b", "fine")
    messages = [{"role": "user", "content": "long shared context " * 20}]
    hashes = gateway.chat_hashes(messages)
    await good_reg.store(hashes[:2])
    await bad_reg.store(hashes)
    await eventually(lambda: gateway.state.index.block_count("a") == len(hashes))
    resp = await gateway.chat(messages)
    assert resp.status == 200
    assert resp.headers["x-kvroute-worker"] == "b"
    assert resp.headers["x-kvroute-reason"] == "retry"  # a was the cache pick, it failed
    assert len(bad.requests) == 1 and len(good.requests) == 1
    metrics = await (await gateway.client.get("/metrics")).text()
    assert 'kvroute_gateway_retries_total{worker_id="a"} 1.0' in metrics
    # a is cooling down now: the next request goes straight to b, by cache (2 blocks).
    resp = await gateway.chat(messages)
    assert (resp.headers["x-kvroute-worker"], resp.headers["x-kvroute-reason"]) == ("b", "cache")
    assert len(bad.requests) == 1


async def test_longest_prefix_wins(gateway: Harness) -> None:
    await gateway.add_worker("a")
    _, reg_b = await gateway.add_worker("b")
    await gateway.add_worker("c")
    messages = [{"role": "user", "content": "tell me about caches " * 12}]
    await reg_b.store(gateway.chat_hashes(messages))
    await eventually(lambda: gateway.state.index.block_count("b") > 0)
    resp = await gateway.chat(messages)
    assert (resp.headers["x-kvroute-worker"], resp.headers["x-kvroute-reason"]) == ("b", "cache")
    metrics = await (await gateway.client.get("/metrics")).text()
    predicted = len(gateway.chat_hashes(messages)) * 16
    assert (
        f'kvroute_gateway_predicted_cached_tokens_total{{worker_id="b"}} {predicted}.0' in metrics
    )


async def test_session_affinity(make_gateway: MakeGateway) -> None:
    # No speculation: the shared system prompt would otherwise count as a cache hit.
    gateway = await make_gateway(speculative_ttl_s=0.0)
    for wid in ("a", "b", "c"):
        await gateway.add_worker(wid)
    first = await gateway.chat(HELLO, headers={"X-Session-ID": "s1"})
    home = first.headers["x-kvroute-worker"]
    for i in range(3):
        other = [{"role": "user", "content": f"unrelated {i}"}]
        resp = await gateway.chat(other, headers={"X-Session-ID": "s1"})
        assert resp.headers["x-kvroute-worker"] == home
        assert resp.headers["x-kvroute-reason"] == "session"
    # `user` works as the session key too
    a = await gateway.chat(HELLO, user="bob")
    b = await gateway.chat([{"role": "user", "content": "x"}], user="bob")
    assert a.headers["x-kvroute-worker"] == b.headers["x-kvroute-worker"]


@pytest.mark.parametrize("ttl", [2.0, 0.0])
async def test_speculative_entries_keep_siblings_together(
    make_gateway: MakeGateway, ttl: float
) -> None:
    gateway = await make_gateway(speculative_ttl_s=ttl)
    for wid in ("a", "b", "c"):
        await gateway.add_worker(wid)
    messages = [{"role": "user", "content": "a shared document " * 30}]
    workers = [(await gateway.chat(messages)).headers["x-kvroute-worker"] for _ in range(3)]
    if ttl:
        assert len(set(workers)) == 1  # no events arrived, speculation kept them together
    else:
        assert len(set(workers)) == 3  # cold ties rotate


async def test_a_queued_request_keeps_its_chain_until_its_first_token(
    make_gateway: MakeGateway,
) -> None:
    # A 0.2 s grace, a first token after 0.8 s: the sibling sent at 0.5 s still finds
    # the chain held on the first request's worker (no cache events ever arrive here).
    import asyncio

    gateway = await make_gateway(speculative_ttl_s=0.2)
    for wid in ("a", "b", "c"):
        await gateway.add_worker(wid, "slow answer", delay_s=0.8)
    messages = [{"role": "user", "content": "a long queued document " * 30}]
    first = asyncio.create_task(gateway.chat(messages))
    await asyncio.sleep(0.5)
    second = await gateway.chat(messages)
    one = await first
    assert one.status == second.status == 200
    assert second.headers["x-kvroute-worker"] == one.headers["x-kvroute-worker"]
    assert second.headers["x-kvroute-reason"] == "cache"
    # After the first tokens, only the grace is left.
    chain = gateway.chat_hashes(messages)
    await eventually(lambda: gateway.state.index.longest_prefix(chain, _now()) == {})


async def test_only_blocks_the_worker_lacks_are_claimed(make_gateway: MakeGateway) -> None:
    # b really holds the first half of the chain (its Redis set says so): routing claims
    # the rest speculatively, so siblings still find the whole chain there, and a
    # sibling's first token shortens only that claim.
    import asyncio

    gateway = await make_gateway(speculative_ttl_s=60.0)
    await gateway.add_worker("a")
    _, reg_b = await gateway.add_worker("b", "slow answer", delay_s=0.5)
    messages = [{"role": "user", "content": "a document half cached on b " * 20}]
    chain = gateway.chat_hashes(messages)
    half = len(chain) // 2
    await reg_b.store(chain[:half])
    index = gateway.state.index
    await eventually(lambda: index.block_count("b") == half)
    first = asyncio.create_task(gateway.chat(messages))
    await eventually(lambda: index.speculative_count() > 0)
    assert index.speculative_count() == len(chain) - half
    assert index.longest_prefix(chain, _now()) == {"b": len(chain)}
    assert index.longest_prefix(chain) == {"b": half}  # real blocks only
    resp = await first
    assert (resp.status, resp.headers["x-kvroute-worker"]) == (200, "b")
    assert index.speculative_count() == len(chain) - half


async def test_a_failed_call_withdraws_its_speculation(gateway: Harness) -> None:
    import grpc

    await gateway.add_worker("a", fail=grpc.StatusCode.UNAVAILABLE)
    messages = [{"role": "user", "content": "never served " * 20}]
    resp = await gateway.chat(messages)
    assert resp.status == 503
    chain = gateway.chat_hashes(messages)
    # The worker holds nothing for a call it failed: no sibling is drawn to it.
    assert gateway.state.index.longest_prefix(chain, _now()) == {}
    assert gateway.state.index.speculative_count() == 0


async def test_the_router_is_told_how_many_requests_want_a_prefix(gateway: Harness) -> None:
    await gateway.add_worker("a")
    messages = [{"role": "user", "content": "the same shared document " * 20}]
    for _ in range(3):
        assert (await gateway.chat(messages)).status == 200
    # The first found nothing cached; the next two found the chain (speculated on a)
    # and were counted against its deepest block, as is this probe.
    chain = gateway.chat_hashes(messages)
    demand = gateway.state.dispatcher.prefix_demand
    assert len(demand) == 1
    # Two requests counted (each decays over 30 s: a slow host may take a second here).
    assert 1.8 < demand.wanted(chain[-1], _now()) <= 2.0


def _now() -> float:
    import time

    return time.monotonic()


async def test_queue_limit_gives_429(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(max_queue_per_worker=2)
    _, reg = await gateway.add_worker("a")
    assert (await gateway.chat(HELLO)).status == 200
    await reg.register(waiting=5, running=4)
    await eventually(lambda: gateway.state.mirror.workers["a"].record.waiting == 5)
    resp = await gateway.chat(HELLO)
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["type"] == "rate_limit_error"


async def test_client_disconnect_cancels_worker(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", "tick " * 200, delay_s=0.02)
    resp = await gateway.chat(HELLO, stream=True, max_tokens=300)
    assert resp.status == 200
    # The role chunk comes before the worker's first token: wait for a token.
    while b"tick" not in await resp.content.readline():
        pass
    resp.close()  # the client goes away mid-stream
    await eventually(lambda: worker.cancelled == 1, what="worker request aborted")
    await eventually(lambda: gateway.state.dispatcher.loads["w1"].inflight == 0)


async def test_dead_worker_is_skipped(gateway: Harness) -> None:
    _, reg_a = await gateway.add_worker("a")
    await gateway.add_worker("b")
    await reg_a.expire()
    await eventually(lambda: "a" not in gateway.state.mirror.workers)
    for _ in range(3):
        resp = await gateway.chat(HELLO)
        assert resp.headers["x-kvroute-worker"] == "b"


async def test_api_keys_and_tenant_salt(make_gateway: MakeGateway, tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"sk-acme": {"tenant": "acme", "cache_salt": "s-acme"}, "sk-beta": "beta"})
    )
    gateway = await make_gateway(api_keys_file=keys, tenant_salt_secret="s3cret")
    await gateway.add_worker("a")
    worker_b, reg_b = await gateway.add_worker("b")
    resp = await gateway.chat(HELLO)
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await gateway.chat(HELLO, headers={"Authorization": "Bearer sk-wrong"})
    assert resp.status == 401
    assert (await gateway.client.get("/healthz")).status == 200  # not behind the key
    messages = [{"role": "user", "content": "tenant data " * 20}]
    await reg_b.store(gateway.chat_hashes(messages, salt="s-acme"))
    await eventually(lambda: gateway.state.index.block_count("b") > 0)
    resp = await gateway.chat(messages, headers={"Authorization": "Bearer sk-acme"})
    assert (resp.headers["x-kvroute-worker"], resp.headers["x-kvroute-reason"]) == ("b", "cache")
    assert worker_b.requests[-1].cache_salt == "s-acme"
    # Another tenant's identical prompt hashes differently: no cache hit anywhere.
    resp = await gateway.chat(messages, headers={"Authorization": "Bearer sk-beta"})
    assert resp.status == 200 and resp.headers["x-kvroute-reason"] != "cache"
    # A tenant without a salt in the file gets an HMAC of its id, never its name.
    salts = {w.requests[-1].cache_salt for w, _ in gateway.workers.values() if w.requests}
    assert tenant_salt(b"s3cret", "beta") in salts and "beta" not in salts, salts
    # The dashboard lists the fleet: behind the keys as well.
    assert (await gateway.client.get("/dashboard/data")).status == 401
    ok = await gateway.client.get("/dashboard/data", headers={"Authorization": "Bearer sk-beta"})
    assert ok.status == 200


async def test_a_stream_retried_after_its_headers_names_the_serving_worker(
    gateway: Harness,
) -> None:
    import grpc

    _, bad_reg = await gateway.add_worker("a", fail=grpc.StatusCode.UNAVAILABLE)
    _, good_reg = await gateway.add_worker("b", "fine")
    messages = [{"role": "user", "content": "another long shared context " * 20}]
    hashes = gateway.chat_hashes(messages)
    await good_reg.store(hashes[:1])
    await bad_reg.store(hashes)
    await eventually(lambda: gateway.state.index.block_count("a") == len(hashes))
    resp = await gateway.chat(messages, stream=True)
    body = await resp.text()
    # Headers went out when the router picked a (by cache); a failed before its first token.
    assert resp.headers["x-kvroute-worker"] == "a"
    assert ": x-kvroute-worker: b\n: x-kvroute-reason: retry\n" in body
    assert body.rstrip().endswith("data: [DONE]")
