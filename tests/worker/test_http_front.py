"""The worker's OpenAI HTTP front end to end: real engine + tiny Llama, real HTTP and Redis.

Chat and completions (streamed or not), SSE, disconnects, stop strings, the
helper endpoints, OpenAI-shaped errors, metrics, n choices and logprobs, cache reset.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.worker.server_stack import BLOCK, NUM_BLOCKS, Stack, random_ids
from worker.serve.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


async def test_chat_stream_matches_non_stream_and_reports_cached_tokens(stack: Stack) -> None:
    args = dict(
        model="tiny",
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "some_unknown_field": {"x": 1}},
    )
    full = await stack.openai.chat.completions.create(**args)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    prompt_ids = stack.tokenizer.encode(
        stack.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert full.usage.prompt_tokens == len(prompt_ids)

    stream = await stack.openai.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // BLOCK * BLOCK > 0


async def test_completions_stream_and_max_completion_tokens(stack: Stack) -> None:
    stream = await stack.openai.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].text async for c in stream if c.choices]
    full = await stack.openai.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert "".join(pieces) == full.choices[0].text
    async with stack.http.post(
        "/v1/completions",
        json={
            "prompt": stack.tokenizer.encode("Once upon a time"),
            "max_completion_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {},
            "whatever": 1,
        },
    ) as resp:
        body = await resp.json()
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # 4 tokens: no block


async def test_raw_sse_ends_with_done(stack: Stack) -> None:
    async with stack.http.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 3, "stream": True, "temperature": 0},
    ) as resp:
        raw = (await resp.read()).decode()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


async def test_http_client_disconnect_aborts_the_request(stack: Stack) -> None:
    async with stack.http.post(
        "/v1/completions",
        json={
            "prompt": "tell me everything",
            "max_tokens": 1000,
            "stream": True,
            "ignore_eos": True,
        },
    ) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        assert stack.engine.stats().running == 1
        resp.close()  # drop the connection mid-stream
    await stack.wait_idle()
    assert stack.engine.stats().running == 0


async def test_stop_string_truncates_and_frees(stack: Stack) -> None:
    args = dict(
        model="tiny",
        prompt="The weather today",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = (await stack.openai.completions.create(**args)).choices[0].text
    assert len(text) >= 8
    stop = text[4:7]
    cut = await stack.openai.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    await stack.wait_idle()


async def test_tokenize_render_and_helper_endpoints(stack: Stack) -> None:
    tok = stack.tokenizer
    async with stack.http.post("/tokenize", json={"prompt": "hello world"}) as resp:
        body = await resp.json()
    assert body["tokens"] == body["token_ids"] == tok.encode("hello world")
    assert body["count"] == len(body["tokens"])
    async with stack.http.post("/detokenize", json={"tokens": body["tokens"]}) as resp:
        assert (await resp.json())["prompt"] == "hello world"
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    async with stack.http.post(
        "/v1/chat/completions/render", json={"model": "tiny", "messages": CHAT}
    ) as resp:
        body = await resp.json()
    assert body["token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert body["prompt"] == rendered
    async with stack.http.post("/v1/completions/render", json={"prompt": "hi"}) as resp:
        assert (await resp.json()) == {"token_ids": tok.encode("hi")}
    async with stack.http.get("/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
    for path in ("/health", "/healthz", "/readyz"):  # the gateway's probe paths as well
        async with stack.http.get(path) as resp:
            assert resp.status == 200, path
    async with stack.http.get("/get_load") as resp:
        load = await resp.json()
    assert load["load"] == 0 and load["free_blocks"] == NUM_BLOCKS
    for path in ("/server_info", "/model_info"):
        async with stack.http.get(path) as resp:
            assert resp.status == 404


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 17}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": [1, 10**7]}, None),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ],
)
async def test_bad_http_input_is_an_openai_shaped_400(
    stack: Stack, path: str, payload: dict, param: str | None
) -> None:
    async with stack.http.post(path, json=payload) as resp:
        body = await resp.json()
    assert resp.status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param
    async with stack.http.post(path, data=b"{not json") as resp:
        assert resp.status == 400
    with pytest.raises(openai.NotFoundError):
        await stack.openai.completions.create(model="other", prompt="x", max_tokens=1)


async def test_metrics_expose_every_documented_name(stack: Stack) -> None:
    await stack.openai.completions.create(
        model="tiny", prompt="a b c", max_tokens=3, extra_body={"ignore_eos": True}
    )
    documented = set(
        re.findall(r"`(kvroute_worker_[a-z0-9_]+)`", (ROOT / "docs" / "INTERFACES.md").read_text())
    )
    assert len(documented) == 17
    wid = ("worker_id", stack.worker_id)
    finished = ("kvroute_worker_requests_total", (("finish_reason", "length"), wid))
    deadline = time.monotonic() + 5
    while True:  # the engine records a finished request just after its last output
        async with stack.http.get("/metrics") as resp:
            text = await resp.text()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not family.name.startswith(("process_", "python_")):
                    assert sample.labels.get("worker_id") == stack.worker_id
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        if samples[finished] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    names = {name for name, _ in samples}
    exposed = names | {n.removesuffix("_count") for n in names}
    assert documented <= exposed, documented - exposed
    assert samples[finished] == 1
    assert samples[("kvroute_worker_generation_tokens_total", (wid,))] == 3
    assert samples[("kvroute_worker_ttft_seconds_count", (wid,))] == 1
    assert samples[("kvroute_worker_inter_token_latency_seconds_count", (wid,))] == 2
    assert samples[("kvroute_worker_block_capacity", (wid,))] == NUM_BLOCKS
    # The states partition the pool: used + free is the capacity, whatever is cached.
    used = samples[("kvroute_worker_blocks", (("state", "used"), wid))]
    free = samples[("kvroute_worker_blocks", (("state", "free"), wid))]
    assert used + free == NUM_BLOCKS
    assert 0 <= samples[("kvroute_worker_cached_blocks", (wid,))] <= NUM_BLOCKS
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert not any(name.startswith("vllm:") for name in names)  # aliases are opt-in


async def test_vllm_metric_aliases_mirror_the_kvroute_counters(stack: Stack) -> None:
    await stack.openai.completions.create(model="tiny", prompt="a b c d e", max_tokens=2)
    text = WorkerMetrics(stack.engine, stack.worker_id, "tiny").render().decode()
    values = {
        (s.name, s.labels.get("model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    prompt = values[("kvroute_worker_prompt_tokens_total", None)]
    assert prompt > 0
    assert values[("vllm:prompt_tokens_total", "tiny")] == prompt
    assert values[("vllm:prefix_cache_queries_total", "tiny")] == prompt
    assert (
        values[("vllm:prefix_cache_hits_total", "tiny")]
        == (values[("kvroute_worker_cached_prompt_tokens_total", None)])
    )
    assert (
        values[("vllm:generation_tokens_total", "tiny")]
        == (values[("kvroute_worker_generation_tokens_total", None)])
    )
    assert ("vllm:num_requests_running", "tiny") in values
    assert 0 <= values[("vllm:kv_cache_usage_perc", "tiny")] <= 1


async def test_http_front_serves_n_choices_and_logprobs(stack: Stack) -> None:
    args: dict = dict(
        model="tiny", prompt="a b c d", max_tokens=4, n=2, temperature=1.0, seed=5,
        logprobs=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    out = await stack.openai.completions.create(**args)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 8
    for c in out.choices:
        lp = c.logprobs
        assert lp is not None and len(lp.token_logprobs) == 4 and "".join(lp.tokens) == c.text
        assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 1 for t in lp.top_logprobs)
    texts = {0: "", 1: ""}
    async for chunk in await stack.openai.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}  # same seeds, same draws


async def test_reset_prefix_cache_over_http_clears_the_pool_and_redis(stack: Stack) -> None:
    await stack.generate(random_ids(40, 11), max_tokens=2)
    assert await stack.wait_set_matches_pool()  # two full blocks cached, in Redis too
    async with stack.http.post("/reset_prefix_cache") as resp:
        assert resp.status == 200
    assert await stack.wait_set_matches_pool() == set()
