"""Function calling end to end: the ``openai`` SDK against a real gateway and a real worker
process (gRPC between them), on tiny random models with Qwen3's chat template (calls in
``<tool_call>`` tokens) and SmolLM2's (no tool format: a bare JSON call).

A forced call (``required``, a named function) comes back as ``tool_calls`` whose arguments
parse and validate against the function's schema, streamed too and from the worker's own
HTTP front; ``none`` is text; with tools in the template the gateway's token ids are the
worker's (same prompt length, the worker's render, and a repeat routed for its cached blocks).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gateway.text.tokenizer import ChatTokenizer
from openai_api.requests import parse_chat
from tests.gateway.pair import Pair, serve_pair

pytestmark = pytest.mark.slow

# Small closed value sets: a random model inside an open string could run to max_tokens.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pair(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    model: Path = request.getfixturevalue(f"tiny_{request.param}")
    logs = tmp_path_factory.mktemp(f"tools-logs-{request.param}")
    with serve_pair(model, redis_url, logs) as p:
        yield p


def _check_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return dict(args)


def test_required_gives_a_tool_call_whose_arguments_validate(pair: Pair) -> None:
    for seed in range(3):
        out = pair.client().chat.completions.create(
            model=pair.name,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=96,
            temperature=1.0,
            seed=seed,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0], {"get_weather", "get_time"})


def test_a_named_function_is_the_one_called(pair: Pair) -> None:
    for client in (pair.client(), pair.worker_client()):
        out = client.chat.completions.create(
            model=pair.name,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=64,
            temperature=0,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_time"]
        assert _check_call(calls[0], {"get_time"})["tz"] in ("UTC", "CET")


def test_none_answers_in_text(pair: Pair) -> None:
    out = pair.client().chat.completions.create(
        model=pair.name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert not choice.message.tool_calls
    assert isinstance(choice.message.content, str) and out.usage is not None
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("front", ["gateway", "worker"])
def test_a_streamed_call_arrives_as_a_tool_calls_delta(pair: Pair, front: str) -> None:
    client = pair.client() if front == "gateway" else pair.worker_client()
    stream = client.chat.completions.create(
        model=pair.name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    content = ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_tools_in_the_template_keep_gateway_and_worker_ids_equal(pair: Pair) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
    }
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    body = {"model": pair.name, "messages": messages, "tools": TOOLS}
    # The worker's render, and the gateway's tokenizer on the same parsed request.
    port = pair.worker.extra["http_port"]
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions/render",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        rendered = json.loads(resp.read())
    worker_ids = rendered["token_ids"]
    tok = ChatTokenizer(pair.model_dir, incremental=False)
    if "tools" in str(tok.tokenizer.chat_template):  # Qwen3's writes them; SmolLM2's cannot
        assert "get_weather" in rendered["prompt"] and "<tool_response>" in rendered["prompt"]
    chat = parse_chat(body)
    text = tok.render(chat.messages, **chat.template_args())
    assert tok.encode_text(text) == worker_ids
    # Through the gateway: its prompt is that long, and a repeat is routed for the blocks
    # the worker announced under the hashes the gateway computed.
    client = pair.client()
    first = client.chat.completions.create(
        model=pair.name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert first.usage is not None and first.usage.prompt_tokens == len(worker_ids)
    deadline = time.monotonic() + 20
    while True:
        raw = client.chat.completions.with_raw_response.create(
            model=pair.name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
        )
        if raw.headers.get("x-kvroute-reason") == "cache" or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert raw.headers.get("x-kvroute-reason") == "cache"
    again = raw.parse()
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
