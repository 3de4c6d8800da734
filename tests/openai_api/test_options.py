"""The options table and the parser: unsupported options are 400s naming the field, neutral
values pass, supported ones parse to exact values; include_stop_str_in_output keeps the stop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from openai_api.detokenizer import Detokenizer
from openai_api.errors import APIError
from openai_api.options import OPTIONS, UNSUPPORTED, options_for
from openai_api.requests import parse_chat, parse_completion

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("web_search_options", {}),
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "x"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("min_tokens", 2),
        ("skip_special_tokens", False),
        ("guided_regex", "a+"),
    ],
)
def test_unsupported_chat_option_is_a_400_naming_it(name: str, value: Any) -> None:
    with pytest.raises(APIError) as err:
        parse_chat({**CHAT, name: value})
    assert (err.value.status, err.value.code, err.value.param) == (
        400,
        "unsupported_parameter",
        name,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("echo", True),
        ("best_of", 3),
        ("suffix", "x"),
        ("use_beam_search", True),
        # vLLM returns the ids in each choice; a client that asked must not get text alone.
        ("return_token_ids", True),
    ],
)
def test_unsupported_completion_option_is_a_400_naming_it(name: str, value: Any) -> None:
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": "x", name: value})
    assert (err.value.code, err.value.param) == ("unsupported_parameter", name)


def test_return_token_ids_false_is_neutral() -> None:
    assert parse_completion({"prompt": "x", "return_token_ids": False}).prompt == "x"


def test_neutral_values_and_supported_options_parse_exactly() -> None:
    chat = parse_chat(
        {
            **CHAT,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "best_of": 5,  # a completions option: not looked at on chat
            "logprobs": True,
            "top_logprobs": 4,
            "logit_bias": {"9": -100, "3": 1.5},
            "presence_penalty": 0.5,
            "repetition_penalty": 1.1,
            "min_p": 0.05,
            "n": 3,
            "include_stop_str_in_output": True,
            "stream_options": {"continuous_usage_stats": True},
        }
    )
    s = chat.sampling
    assert s.logprobs == 4 and s.logit_bias == ((3, 1.5), (9, -100.0)) and s.n == 3
    assert (s.presence_penalty, s.repetition_penalty, s.min_p) == (0.5, 1.1, 0.05)
    assert s.include_stop_str_in_output and s.continuous_usage_stats and not s.include_usage
    assert parse_chat({**CHAT, "logprobs": True}).sampling.logprobs == 0
    assert parse_chat({**CHAT, "logprobs": False}).sampling.logprobs is None
    assert parse_completion({"prompt": "x", "logprobs": 2}).sampling.logprobs == 2
    assert parse_completion({"prompt": "x", "logprobs": 0}).sampling.logprobs == 0


def test_response_format_is_the_json_schema_text() -> None:
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert json.loads(parse_chat({**CHAT, "response_format": rf}).sampling.json_schema) == schema
    as_object = parse_chat({**CHAT, "response_format": {"type": "json_object"}}).sampling
    assert json.loads(as_object.json_schema or "") == {"type": "object"}
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).sampling.json_schema is None
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(APIError) as err:
            parse_chat({**CHAT, "response_format": bad})
        assert err.value.param == "response_format"


def test_every_unsupported_option_has_a_default_that_passes() -> None:
    for endpoint in ("chat", "completion"):
        for name, (status, _) in options_for(endpoint).items():
            assert name in OPTIONS
            if status == UNSUPPORTED:
                body = {**CHAT} if endpoint == "chat" else {"prompt": "x"}
                (parse_chat if endpoint == "chat" else parse_completion)({**body, name: None})


def test_include_stop_keeps_the_stop_string(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.encode("one two three four", add_special_tokens=False)
    for include, expected in ((False, "one two"), (True, "one two three")):
        d = Detokenizer(tok, [], [" three"], include_stop=include)
        text = d.push(ids) + d.finish()
        assert d.stopped and text == expected and d.output_text == expected


@pytest.mark.parametrize(
    "extra",
    [
        {"stop_token_ids": [2**32]},
        {"stop_token_ids": [19286568858330295117248515276800]},  # found by the fuzz suite
        {"logit_bias": {str(2**40): 1}},
    ],
)
def test_token_ids_beyond_uint32_are_a_400_not_a_500(extra: dict) -> None:
    from openai_api.errors import APIError
    from openai_api.requests import parse_chat

    with pytest.raises(APIError) as err:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **extra})
    assert err.value.status == 400 and err.value.param == next(iter(extra))
