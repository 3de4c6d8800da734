"""The gateway driven by the official ``openai`` SDK: what real clients send either works or is
a clear 400 ``unsupported_parameter`` (fake gRPC workers; real Redis, HTTP and tokenizer)."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from openai_api.options import OPTIONS, UNSUPPORTED
from tests.gateway.conftest import MODEL, Harness, MakeGateway, read_sse

HELLO = [{"role": "user", "content": "Hello"}]

# (endpoint, option values) a client may send that this server does not implement.
UNSUPPORTED_CASES: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"min_tokens": 3}),
    ("chat", {"guided_json": {"type": "object"}}),
    ("completion", {"skip_special_tokens": False}),
    ("chat", {"functions": [{"name": "f"}]}),
    ("chat", {"modalities": ["text", "audio"]}),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("chat", {"prediction": {"type": "content", "content": "x"}}),
    ("completion", {"echo": True}),
    ("completion", {"best_of": 2}),
    ("completion", {"suffix": "end"}),
]


def _sdk(gateway: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=str(gateway.client.make_url("/v1")), api_key="none", max_retries=0
    )


async def test_every_unsupported_option_is_a_400_naming_it(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1")
    client = _sdk(gateway)
    for endpoint, extra in UNSUPPORTED_CASES:
        with pytest.raises(openai.BadRequestError) as err:
            if endpoint == "chat":
                await client.chat.completions.create(
                    model=MODEL, messages=HELLO, max_tokens=4, extra_body=extra
                )
            else:
                await client.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=4, extra_body=extra
                )
        body = err.value.body
        assert isinstance(body, dict), extra
        assert body["code"] == "unsupported_parameter", (extra, body)
        assert body["param"] in extra, (extra, body)
    assert worker.requests == []  # nothing reached a worker


async def test_neutral_values_of_unsupported_options_are_accepted(gateway: Harness) -> None:
    await gateway.add_worker("w1")
    client = _sdk(gateway)
    neutral = {
        "logprobs": False,
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "store": True,
        "metadata": {"a": "b"},
        "parallel_tool_calls": False,
        "top_logprobs": 0,
    }
    out = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, extra_body=neutral
    )
    assert out.choices[0].message.content == "Hello world"
    out = await client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, echo=False, best_of=1, suffix=None, logprobs=None
    )
    assert out.choices[0].text == "Hello world"


async def test_top_p_zero_is_greedy(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1")
    await _sdk(gateway).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, temperature=0.9, top_p=0
    )
    sampling = worker.requests[-1].sampling
    assert sampling.temperature == 0.0 and sampling.top_p == 1.0


async def test_sampling_options_reach_the_worker(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1")
    await _sdk(gateway).chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"42": -100, "7": 3},
        logprobs=True,
        top_logprobs=2,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
    )
    s = worker.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.25)
    assert abs(s.repetition_penalty - 1.3) < 1e-6 and abs(s.min_p - 0.1) < 1e-6
    assert dict(s.logit_bias) == {42: -100.0, 7: 3.0}
    assert s.HasField("logprobs") and s.logprobs == 2
    await _sdk(gateway).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    plain = worker.requests[-1].sampling
    assert not plain.HasField("logprobs") and not plain.logit_bias


async def test_invalid_sampling_options_are_400_naming_them(gateway: Harness) -> None:
    await gateway.add_worker("w1")
    client = _sdk(gateway)
    for extra, param in (
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 17}, "n"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=4, extra_body=extra
            )
        assert isinstance(err.value.body, dict) and err.value.body["param"] == param, extra


async def test_continuous_usage_stats_puts_usage_in_every_chunk(gateway: Harness) -> None:
    await gateway.add_worker("w1", "one two three four five", cached_tokens=16)
    stream = await _sdk(gateway).chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = [c async for c in stream]
    assert len(chunks) >= 5
    counts = []
    for c in chunks:
        assert c.usage is not None, c
        assert c.usage.prompt_tokens > 0
        counts.append(c.usage.completion_tokens)
    assert counts == sorted(counts) and counts[0] == 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == counts[-1] > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16


async def test_completions_stream_continuous_usage_without_include_usage(
    gateway: Harness,
) -> None:
    await gateway.add_worker("w1", "one two three")
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    events = await read_sse(await gateway.client.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert all(c["choices"] for c in chunks)  # no final usage-only chunk without include_usage


async def test_models_retrieve_and_the_smollm2_alias(gateway: Harness) -> None:
    await gateway.add_worker("w1")
    client = _sdk(gateway)
    assert (await client.models.retrieve(MODEL)).id == MODEL
    assert (await client.models.retrieve("smollm2")).id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4")
    listed = [m.id async for m in client.models.list()]
    assert listed == [MODEL, "smollm2"]
    out = await client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=4)
    assert out.model == "smollm2" and out.choices[0].message.content == "Hello world"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4", messages=HELLO, max_tokens=4)


async def test_served_model_name_lists_several(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(served_model_name="tiny, chat-small")
    await gateway.add_worker("w1")
    client = _sdk(gateway)
    assert [m.id async for m in client.models.list()] == ["tiny", "chat-small"]
    out = await client.completions.create(model="chat-small", prompt="Hi", max_tokens=4)
    assert out.model == "chat-small"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)


async def test_stream_headers_arrive_before_the_first_token(gateway: Harness) -> None:
    delay = 1.0
    await gateway.add_worker("w1", "slow", delay_s=delay)  # each token takes a second
    started = time.monotonic()
    resp = await gateway.chat(HELLO, stream=True)
    headers_after = time.monotonic() - started
    assert resp.status == 200
    assert resp.headers["x-kvroute-worker"] == "w1"
    assert resp.headers["x-kvroute-reason"] in ("cache", "session", "load", "fallback")
    assert headers_after < delay / 2, headers_after
    events = await read_sse(resp)
    assert time.monotonic() - started >= delay
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == "slow"


async def test_no_worker_after_the_headers_is_an_in_band_error(gateway: Harness) -> None:
    import grpc

    await gateway.add_worker("w1", fail=grpc.StatusCode.UNAVAILABLE)
    resp = await gateway.chat(HELLO, stream=True)
    assert resp.status == 200  # routed: the headers went out before the worker failed
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["code"] == "no_workers"


async def test_openapi_lists_every_option_with_its_status(gateway: Harness) -> None:
    spec = await (await gateway.client.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    for name, (status, endpoints, _, _) in OPTIONS.items():
        for endpoint, schema in (("chat", "ChatRequest"), ("completion", "CompletionRequest")):
            props = schemas[schema]["properties"]
            if endpoint not in endpoints:
                assert name not in props or name in ("model",), (name, schema)
                continue
            assert name in props, (name, schema)
            if name not in ("model", "messages", "prompt"):
                assert props[name]["x-kvroute-support"] == status, name
    chat = schemas["ChatRequest"]["properties"]
    assert chat["tools"]["x-kvroute-support"] == "supported"
    assert chat["tool_choice"]["x-kvroute-support"] == "supported"
    assert chat["functions"]["x-kvroute-support"] == UNSUPPORTED
    assert chat["store"]["x-kvroute-support"] == "ignored"
    assert "/v1/models/{model}" in spec["paths"]


async def test_n_choices_go_to_one_worker_after_the_first_token(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", "a b c", delay_s=0.05)
    await gateway.add_worker("w2", "a b c", delay_s=0.05)
    client = _sdk(gateway)
    out = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, n=3, seed=7, temperature=0.8
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "a b c" for c in out.choices)
    reqs = worker.requests or gateway.workers["w2"][0].requests
    assert len(reqs) == 3 and len(worker.requests) in (0, 3)  # all on one worker
    rid = reqs[0].request_id
    assert [r.request_id for r in reqs] == [rid, f"{rid}-1", f"{rid}-2"]
    assert [r.sampling.seed for r in reqs] == [7, 8, 9]  # a different draw per choice
    assert out.usage.completion_tokens == 3 * 4  # "a b c" + <|im_end|>, three times
    stream = await client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=8,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finished = set()
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
        if not chunk.choices:
            assert chunk.usage is not None and chunk.usage.completion_tokens == 2 * 4
    assert texts == {0: "a b c", 1: "a b c"} and finished == {0, 1}


async def test_include_stop_str_in_output(gateway: Harness) -> None:
    await gateway.add_worker("w1", "one two three four")
    client = _sdk(gateway)
    for extra, expected in (
        ({}, "one two"),
        ({"include_stop_str_in_output": True}, "one two three"),
    ):
        out = await client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=8, stop=[" three"], extra_body=extra
        )
        assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")


async def test_response_format_reaches_the_worker_as_a_schema(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", '{"a": 1}')
    client = _sdk(gateway)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert json.loads(worker.requests[-1].sampling.json_schema) == schema
    await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, response_format={"type": "json_object"}
    )
    assert json.loads(worker.requests[-1].sampling.json_schema) == {"type": "object"}
    await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, response_format={"type": "text"}
    )
    assert worker.requests[-1].sampling.json_schema == ""
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=8, extra_body={"response_format": bad}
            )
        assert isinstance(err.value.body, dict) and err.value.body["param"] == "response_format"


TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
CALL_TEXT = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


async def test_auto_reads_a_tool_call_out_of_the_answer(gateway: Harness) -> None:
    """SmolLM2's template has no tool format: a bare JSON call is one (the fake worker
    answers with it, as a model choosing to call would)."""
    await gateway.add_worker("w1", CALL_TEXT)
    client = _sdk(gateway)
    out = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=32, tools=[TIME_TOOL]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_time")]
    assert json.loads(calls[0].function.arguments) == {"tz": "UTC"}
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=32, tools=[TIME_TOOL], stream=True
    )
    deltas = [c.choices[0] async for c in stream if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == ""
    streamed = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [(t.index, t.function.name) for t in streamed] == [(0, "get_time")]
    assert streamed[0].id.startswith("call_") and streamed[0].function.arguments == '{"tz": "UTC"}'
    assert deltas[-1].finish_reason == "tool_calls"
    # tool_choice none: the same text is just content.
    out = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=32, tools=[TIME_TOOL], tool_choice="none"
    )
    assert out.choices[0].message.content == CALL_TEXT and not out.choices[0].message.tool_calls


async def test_auto_text_answers_stay_text(gateway: Harness) -> None:
    await gateway.add_worker("w1")
    out = await _sdk(gateway).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, tools=[TIME_TOOL], tool_choice="auto"
    )
    assert out.choices[0].message.content == "Hello world"
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls


async def test_a_forced_call_sends_its_schema_to_the_worker(gateway: Harness) -> None:
    worker, _ = await gateway.add_worker("w1", CALL_TEXT)
    choice = {"type": "function", "function": {"name": "get_time"}}
    out = await _sdk(gateway).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=32, tools=[TIME_TOOL], tool_choice=choice
    )
    assert out.choices[0].finish_reason == "tool_calls"
    schema = json.loads(worker.requests[-1].sampling.json_schema)
    assert schema["properties"]["name"] == {"const": "get_time"}
    assert schema["properties"]["arguments"] == TIME_TOOL["function"]["parameters"]
