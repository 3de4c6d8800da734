"""Function calling in the shared parser and the tool-call reader: ``tools`` / ``tool_choice``
shapes (400s name the field), tool messages, the forced-call grammar (compiled by llguidance
over Qwen3's vocabulary, where ``<tool_call>`` is a token) and calls parsed out of text,
whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openai_api.errors import APIError
from openai_api.requests import parse_chat
from openai_api.tools import (
    HERMES,
    HERMES_TOKENS,
    JSON,
    ToolCallStream,
    constraint,
    parse_tool_calls,
    tool_format,
)

MSGS = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _chat(**extra: Any) -> Any:
    return parse_chat({"messages": MSGS, **extra})


def test_tools_parse_with_auto_as_the_default_choice() -> None:
    req = _chat(tools=[WEATHER, TIME])
    assert req.tools is not None
    assert (req.tools.choice, req.tools.name, req.tools.forced) == ("auto", None, False)
    assert [t["function"]["name"] for t in req.tools.tools] == ["get_weather", "get_time"]
    assert req.template_args()["tools"][0] == WEATHER
    assert req.tools.parameters("get_time") == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", ("none", None)),
        ("auto", ("auto", None)),
        ("required", ("required", None)),
        ({"type": "function", "function": {"name": "get_time"}}, ("function", "get_time")),
    ],
)
def test_tool_choice_values(choice: Any, expected: tuple[str, str | None]) -> None:
    req = _chat(tools=[WEATHER, TIME], tool_choice=choice)
    assert req.tools is not None
    assert (req.tools.choice, req.tools.name) == expected


def test_no_tools_means_no_tool_handling() -> None:
    assert _chat().tools is None
    assert _chat(tools=[], tool_choice="none").tools is None
    assert _chat().template_args() == {}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[1].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools[0].function.description",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ],
)
def test_bad_tool_shapes_are_400s_naming_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        _chat(**extra)
    assert (err.value.status, err.value.param) == (400, param)
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_tool_messages_and_assistant_tool_calls() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    req = parse_chat(
        {
            "messages": [
                *MSGS,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        }
    )
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant == {
        "role": "assistant",
        "content": "",
        # Templates take the arguments as an object (as vLLM passes them).
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "tool", "tool_call_id": "c"}, "messages[1].content"),
        ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[1].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_bad_tool_messages_are_400s(message: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_chat({"messages": [*MSGS, message]})
    assert (err.value.status, err.value.param) == (400, param)


# -- reading calls out of text ---------------------------------------------------------


def test_hermes_calls_are_parsed_out_of_the_text() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed (cut off)
    ],
)
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, HERMES) == (text, [])


def test_json_format_reads_one_bare_call() -> None:
    content, calls = parse_tool_calls(' {"name": "get_time", "arguments": {"tz": "UTC"}}', JSON)
    assert content is None and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    assert parse_tool_calls("{}", JSON) == ("{}", [])


def _stream(pieces: list[str], choice: str, fmt: str = HERMES) -> tuple[list[str], Any]:
    req = _chat(tools=[WEATHER, TIME], tool_choice=choice)
    stream = ToolCallStream(req.tools, fmt)
    out = [stream.push(p) for p in pieces]
    out.append(stream.finish())
    return out, stream


def test_auto_streams_text_and_holds_back_a_call() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = "Checking. " + call
    out, stream = _stream(list(text), "auto")
    assert "".join(out) == "Checking. "  # the space went out before the call began
    assert out[: len("Checking. ")] == list("Checking. ")  # sent as it came
    assert [c["function"]["name"] for c in stream.calls] == ["get_time"]
    assert stream.content() == "Checking."


def test_auto_holds_a_possible_tag_only_until_it_is_not_one() -> None:
    out, stream = _stream(["a <tool", "_ca", "rpet"], "auto")
    assert out == ["a ", "", "<tool_carpet", ""]
    assert stream.calls == [] and stream.content() == "a <tool_carpet"
    out, _ = _stream(["a <tool"], "auto")
    assert out == ["a ", "<tool"]  # the end of the text releases what was held


def test_a_forced_call_holds_everything() -> None:
    out, stream = _stream(['{"name": "get_time", ', '"arguments": {}}'], "required", JSON)
    assert out == ["", "", ""]
    assert stream.content() is None and len(stream.calls) == 1


# -- the grammar of a forced call -------------------------------------------------------


class _Tok:
    def __init__(self, template: str | None, added: dict[str, int]) -> None:
        self.chat_template = template
        self._added = added

    def get_added_vocab(self) -> dict[str, int]:
        return self._added


def test_tool_format_follows_the_template() -> None:
    assert tool_format(_Tok(None, {})) == JSON
    assert tool_format(_Tok("{{ messages }}", {})) == JSON
    assert tool_format(_Tok("<tool_call>{{ tool }}</tool_call>", {})) == HERMES
    added = {"<tool_call>": 1, "</tool_call>": 2}
    assert tool_format(_Tok("<tool_call>{{ tool }}</tool_call>", added)) == HERMES_TOKENS


def test_constraint_only_when_a_call_is_forced() -> None:
    assert constraint(_chat(tools=[WEATHER]).tools, HERMES) == (None, None)
    assert constraint(_chat(tools=[WEATHER], tool_choice="none").tools, JSON) == (None, None)
    schema, grammar = constraint(_chat(tools=[WEATHER], tool_choice="required").tools, JSON)
    assert grammar is None and schema is not None
    assert json.loads(schema)["properties"]["name"] == {"const": "get_weather"}
    schema, grammar = constraint(_chat(tools=[WEATHER, TIME], tool_choice="required").tools, JSON)
    assert schema is not None and len(json.loads(schema)["anyOf"]) == 2


def _qwen3() -> Any:
    pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from tests.models import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


def _accepts(tokenizer: Any, grammar: str, ids: list[int]) -> bool:
    import llguidance
    import llguidance.hf

    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def test_the_qwen3_grammar_forces_a_call_of_the_named_function() -> None:
    tok = _qwen3()
    fmt = tool_format(tok)
    assert fmt == HERMES_TOKENS
    choice = {"type": "function", "function": {"name": "get_weather"}}
    _, grammar = constraint(_chat(tools=[WEATHER, TIME], tool_choice=choice).tools, fmt)
    assert grammar is not None

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    good = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert ids("<tool_call>")[:1] == [tok.convert_tokens_to_ids("<tool_call>")]
    assert _accepts(tok, grammar, ids(good))
    assert not _accepts(tok, grammar, ids(good.replace('"city"', '"town"')))
    assert not _accepts(tok, grammar, ids(good.replace("get_weather", "get_time")))
    # The tags must be Qwen's own tokens, as the model writes them, not spelled out.
    assert not _accepts(tok, grammar, [ids("<")[0]])
