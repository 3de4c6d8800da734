"""openai_api.json_body: what both OpenAI fronts accept as a body, and how answers are written."""

from __future__ import annotations

import json

import pytest

from openai_api.errors import APIError
from openai_api.json_body import dumps, parse_body


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 1e400}',  # past a double's range
        b'"\\ud800"',  # a lone high surrogate
        b'"\\udc80x"',  # a lone low one
        b'"\xed\xa0\x80"',  # a surrogate as (invalid) UTF-8
        b"\xff",
        b"[" * 2000 + b"]" * 2000,
        b'{"a": 1} x',
    ],
)
def test_what_is_not_strict_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(APIError) as err:
        parse_body(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"


def test_bodies_parse_as_pythons_json_reads_them() -> None:
    body = {"messages": [{"role": "user", "content": "é 😀 \u2028 \x00"}], "n": 2, "t": 0.5}
    raw = json.dumps(body).encode()
    assert parse_body(raw) == body == parse_body(json.dumps(body, ensure_ascii=False).encode())
    assert parse_body(b"\xef\xbb\xbf" + raw) == body  # a byte order mark, as json.loads allows
    assert parse_body(b'"\\ud83d\\ude00"') == "😀"  # a surrogate pair is one character
    # Past 64 bits an integer is a float, which integer fields refuse.
    assert isinstance(parse_body(b"123456789012345678901234567890"), float)


def test_answers_are_compact_utf8_and_keep_what_orjson_cannot_write() -> None:
    assert dumps({"a": "é", "b": [1, None]}) == '{"a":"é","b":[1,null]}'.encode()
    assert json.loads(dumps({"big": 2**70})) == {"big": 2**70}
    # A masked token's logprob stays -Infinity (orjson alone would write null).
    assert b"-Infinity" in dumps({"logprob": float("-inf")}, nonfinite=True)
    assert dumps({"logprob": float("-inf")}) == b'{"logprob":null}'
