"""kvroute in front of real vLLM CPU servers, joined by the bridge (no mock of vLLM).

The tests share one fleet (``conftest.fleet``) and run in file order: the
restart test comes last because it restarts ``vllm-1``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import redis

from contract.hashing import block_hashes
from contract.model_paths import served_model_name
from loadtest.fleet import Fleet, FleetConfig
from loadtest.vllm_fleet import VllmFleet
from tests.vllm.conftest import (
    HEARTBEAT_TTL,
    NUM_BLOCKS,
    gateway_counter,
    held_blocks,
    published_blocks,
    record,
    scrape,
    spec,
    vllm_gauge,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = (
    "You are a careful assistant for a team that runs inference fleets. Answer in one short "
    "sentence. Be concrete: name the component, the number and the unit. "
) * 4


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


def post(url: str, body: dict[str, Any]) -> Reply:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            return Reply(resp.status, headers, json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, {}, exc.read().decode())


def chat(base: str, messages: list[dict[str, str]], max_tokens: int = 12) -> Reply:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    resp = post(f"{base}/v1/chat/completions", body)
    assert resp.status == 200, resp.body
    return resp


def full_blocks_match(cached: int, predicted: int, prompt_tokens: int) -> bool:
    """vLLM never hits a prompt's last token: a prompt that is whole blocks hits one block less."""
    if cached == predicted:
        return True
    return predicted == prompt_tokens and prompt_tokens % 32 == 0 and cached == predicted - 32


def opening(topic: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{topic}, question 0: what limits throughput?"},
    ]


def converse(
    base: str, counter: Callable[[str], float], turns: int, topic: str, system: str = SYSTEM
) -> list[tuple[str, int, int, int]]:
    """A conversation through the gateway: (worker, prompt tokens, cached, predicted) per turn.

    One request at a time: ``counter`` deltas are this request's prediction.
    """
    messages = opening(topic, system)[:1]
    out = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"{topic}, question {turn}: what limits throughput?"}
        )
        before = {w: counter(w) for w in ("vllm-0", "vllm-1", "worker-0")}
        resp = chat(base, messages)
        worker = resp.headers["x-kvroute-worker"]
        usage = resp.body["usage"]
        predicted = counter(worker) - before.get(worker, 0.0)
        out.append(
            (
                worker,
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                int(predicted),
            )
        )
        messages.append(
            {"role": "assistant", "content": resp.body["choices"][0]["message"]["content"]}
        )
        time.sleep(1.0)  # the answer's blocks: vLLM event -> bridge -> Redis -> gateway mirror
    return out


def test_multi_turn_conversation_stays_on_the_worker_holding_it(fleet: VllmFleet) -> None:
    def predicted(worker: str) -> float:
        return gateway_counter(
            fleet.gateway_url, "kvroute_gateway_predicted_cached_tokens_total", worker
        )

    turns = converse(fleet.gateway_url, predicted, 4, "GPU memory")
    first = turns[0][0]
    assert first in ("vllm-0", "vllm-1")
    for i, (worker, prompt, cached, pred) in enumerate(turns):
        assert full_blocks_match(cached, pred, prompt), (i, turns)
        assert cached % 32 == 0
        if i:
            assert worker == first, turns
            assert cached >= 32 * ((turns[i - 1][1]) // 32) - 32, turns  # the previous prompt hit
    assert turns[-1][2] > 0
    # The turns went over kept-alive connections, as the gateway's metrics count them.
    connections = {
        labels: v
        for (n, labels), v in scrape(fleet.gateway_url).items()
        if n == "kvroute_gateway_upstream_http_connections_total"
    }
    assert connections['event="reused"'] >= 1, connections


def test_openai_sdk_streaming_usage_and_disconnect(fleet: VllmFleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused")
    model = served_model_name(fleet.model_dir)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name one cause of a cold cache."},
    ]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert text and finish and finish[-1] in ("length", "stop")
    assert usage is not None and usage.prompt_tokens > 40 and 0 < usage.completion_tokens <= 10
    # The same prompt again: vLLM reports the whole blocks it had, through the gateway.
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 32 * ((usage.prompt_tokens - 1) // 32)
    plain = client.completions.create(
        model=model, prompt="The KV cache holds", max_tokens=5, temperature=0
    )
    assert plain.choices[0].text and plain.usage is not None and plain.usage.completion_tokens == 5

    # Disconnect: the client goes away after three chunks; vLLM stops generating.
    before = {s.name: vllm_gauge(s, "vllm:generation_tokens_total") for s in fleet.servers}
    long = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a very long story about caches."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for got, _chunk in enumerate(long, start=1):
        if got == 3:
            break
    long.close()
    eventually(
        lambda: all(vllm_gauge(s, "vllm:num_requests_running") == 0 for s in fleet.servers),
        10,
        "vLLM to abort the request",
    )
    generated = sum(
        vllm_gauge(s, "vllm:generation_tokens_total") - before[s.name] for s in fleet.servers
    )
    # The first chunk carries only the role: three chunks are two tokens or more.
    assert 2 <= generated < 200, generated


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _until_vllm_served(
    fleet: VllmFleet,
    question: Callable[[int], str],
    check: Callable[[str, Any], None],
    **options: Any,
) -> None:
    """Sampled chats (seed n, temperature 0.7) through the gateway, ``check(worker,
    choice)`` on each, until a vLLM worker has served one past the first two."""
    client = openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused")
    model = served_model_name(fleet.model_dir)
    served: set[str] = set()
    for n in range(8):
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": question(n)}],
            temperature=0.7,
            seed=n,
            **options,
        )
        worker = raw.headers["x-kvroute-worker"]
        served.add(worker)
        check(worker, raw.parse().choices[0])
        if worker.startswith("vllm-") and n >= 2:
            break
    assert any(w.startswith("vllm-") for w in served), served


def test_sampling_options_pass_through_to_vllm(fleet: VllmFleet) -> None:
    """logprobs, top_logprobs, a JSON schema, penalties and a seed reach whichever worker
    serves, vLLM included: the gateway must not drop what vLLM implements."""

    def check(worker: str, choice: Any) -> None:
        parsed = json.loads(choice.message.content or "")
        assert set(parsed) == {"answer"} and isinstance(parsed["answer"], str), (worker, parsed)
        assert len(parsed["answer"]) <= 12, (worker, parsed)
        assert choice.logprobs is not None and choice.logprobs.content, worker
        for token in choice.logprobs.content:
            assert token.logprob <= 0.0 and len(token.top_logprobs) == 2, (worker, token)

    _until_vllm_served(
        fleet,
        lambda n: f"Topic {n}: name one cache in one word.",
        check,
        max_tokens=24,
        presence_penalty=0.5,
        logprobs=True,
        top_logprobs=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
        },
    )


CITY_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_tool_call_is_served_by_vllm(fleet: VllmFleet) -> None:
    """A named tool_choice reaches vLLM as the gateway's constraint and comes back as
    ``tool_calls`` whose arguments validate, whichever worker serves."""

    def check(worker: str, choice: Any) -> None:
        assert choice.finish_reason == "tool_calls", (worker, choice)
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather", (worker, call)
        args = json.loads(call.function.arguments)
        assert args in ({"city": "Paris"}, {"city": "Oslo"}, {"city": "Lima"}), (worker, args)

    _until_vllm_served(
        fleet,
        lambda n: f"Question {n}: what is the weather?",
        check,
        max_tokens=48,
        tools=[CITY_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_published_set_equals_vllm_blocks_through_evictions(
    fleet: VllmFleet, rdb: redis.Redis
) -> None:
    server = fleet.servers[1]
    for seed in (11, 12, 13, 14):  # 4 x 31 blocks on a 95-block pool: evictions
        body = {"prompt": _ids(seed, 1000), "max_tokens": 1, "temperature": 0}
        resp = post(f"{server.url}/v1/completions", body)
        assert resp.status == 200, resp.body
    expected, removals = held_blocks(server, spec(fleet))
    assert removals > 0 and len(expected) <= NUM_BLOCKS - 1
    eventually(lambda: published_blocks(rdb, "vllm-1") == expected, 10, "the bridge's set")
    assert set(block_hashes(_ids(14, 1000), spec(fleet))) <= expected  # the newest is whole


def test_mixed_fleet_of_a_kvroute_worker_and_a_vllm_worker(fleet: VllmFleet) -> None:
    config = FleetConfig(
        workers=1,
        redis_url=fleet.redis_url,
        namespace="mixed",
        block_size=32,
        num_blocks=512,
        heartbeat_interval=0.5,
        heartbeat_ttl=HEARTBEAT_TTL,
        log_dir=os.path.join(fleet.config.log_dir, "mixed") if fleet.config.log_dir else "",
    )
    with Fleet(config) as mixed:
        bridge = fleet.start_bridge(fleet.servers[0], namespace="mixed", name="vllm-0")
        try:
            eventually(lambda: mixed.healthy_workers() == 2, 60, "both workers in the mixed fleet")

            def predicted(worker: str) -> float:
                return gateway_counter(
                    mixed.gateway_url, "kvroute_gateway_predicted_cached_tokens_total", worker
                )

            # Each conversation has its own system prompt, first sent straight to one
            # worker's own OpenAI front (each engine renders the chat itself): the gateway
            # must find it there from that engine's announcements, and keep it there.
            homes = {"disks": mixed.workers[0].http_url, "networks": fleet.servers[0].url}
            systems = {t: f"Topic: {t}. {SYSTEM}" for t in homes}
            for topic, url in homes.items():
                warm = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "temperature": 0}
                resp = post(
                    f"{url}/v1/chat/completions",
                    {**warm, "messages": opening(topic, systems[topic])},
                )
                assert resp.status == 200, resp.body
            time.sleep(1.5)
            results = {t: converse(mixed.gateway_url, predicted, 3, t, systems[t]) for t in homes}
            assert [r[0] for r in results["disks"]] == ["worker-0"] * 3, results
            assert [r[0] for r in results["networks"]] == ["vllm-0"] * 3, results
            for turns in results.values():
                for _worker, prompt, cached, pred in turns:
                    assert cached > 0 and full_blocks_match(cached, pred, prompt), turns
        finally:
            bridge.send_signal(signal.SIGTERM)
            bridge.wait(timeout=10)
            fleet.bridges.pop("mixed:vllm-0", None)


def test_vllm_killed_and_restarted_under_its_bridge(fleet: VllmFleet, rdb: redis.Redis) -> None:
    server = fleet.servers[1]
    resp = post(f"{server.url}/v1/completions", {"prompt": _ids(21, 300), "max_tokens": 1})
    assert resp.status == 200, resp.body
    eventually(lambda: len(published_blocks(rdb, "vllm-1")) >= 9, 10, "blocks before the kill")
    old_epoch = record(rdb, "vllm-1")["epoch"]
    old_blocks = published_blocks(rdb, "vllm-1")
    server.stop(signal.SIGKILL)
    # It leaves routing within two TTLs: the bridge deregisters on the lost connection.
    eventually(lambda: not record(rdb, "vllm-1"), 2 * HEARTBEAT_TTL, "the registry key to go")
    eventually(lambda: fleet.healthy_workers() == 1, 2 * HEARTBEAT_TTL, "the gateway to drop it")
    resp = chat(fleet.gateway_url, [{"role": "user", "content": "still there?"}], max_tokens=2)
    assert resp.headers["x-kvroute-worker"] == "vllm-0"

    server.start()
    server.wait_healthy(600)
    eventually(lambda: bool(record(rdb, "vllm-1")), 30, "the bridge to re-register")
    new_epoch = record(rdb, "vllm-1")["epoch"]
    assert new_epoch != old_epoch
    assert not published_blocks(rdb, "vllm-1") & old_blocks  # stale blocks are gone
    eventually(lambda: fleet.healthy_workers() == 2, 10, "the gateway to route to it again")
    body = {"prompt": _ids(14, 1000), "max_tokens": 1, "temperature": 0}
    resp = post(f"{server.url}/v1/completions", body)
    assert resp.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    expected, _ = held_blocks(server, spec(fleet))
    eventually(lambda: published_blocks(rdb, "vllm-1") == expected, 10, "the new epoch's set")
    assert record(rdb, "vllm-1")["epoch"] == new_epoch


def test_vllm_takes_the_gateways_request_id(fleet: VllmFleet) -> None:
    """The openai-http upstream sends each try's id as ``X-Request-Id``; vLLM names the
    request after it (its stream's ``id``), so its logs name the gateway's request."""
    raw = asyncio.run(_vllm_stream(fleet.servers[0].url, "chatcmpl-0f3a-1"))
    events = [json.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert events and {e["id"] for e in events} == {"cmpl-chatcmpl-0f3a-1"}


async def _vllm_stream(url: str, request_id: str) -> bytes:
    from gateway.upstream.http1 import Pool, Target

    pool = Pool(5.0)
    target = Target(url + "/v1/completions", {"Content-Type": "application/json"})
    body = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 2, "stream": True}).encode()
    conn = await pool.connect(target)
    try:
        conn.begin(target.request(body, request_id))
        assert await conn.head() == 200
        out = b""
        while data := await conn.read():
            out += data
        return out
    finally:
        pool.close()
