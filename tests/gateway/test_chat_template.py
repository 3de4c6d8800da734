"""The direct chat-template render equals ``apply_chat_template`` (SmolLM2's and Qwen3's).

The gateway's ids must be the worker's, so the text must be exactly what
transformers renders; anything the direct path does not handle goes to
transformers, which these tests also check.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.text.chat_template import DirectTemplate
from gateway.text.tokenizer import ChatTokenizer


def _transformers(tok: ChatTokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tok.tokenizer.apply_chat_template(
        messages, add_generation_prompt=kwargs.pop("add", True), tokenize=False, **kwargs
    )
    assert isinstance(text, str)
    return text


_TEXT = st.lists(
    st.sampled_from([*"ab <>|\n\t é世😀{}%#", "<|im_end|>", "<think>", "</think>"]),
    max_size=12,
).map("".join)


@st.composite
def chats(draw: st.DrawFn) -> list[dict[str, str]]:
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_TEXT)})
    for turn in range(draw(st.integers(1, 4))):
        if turn:
            messages.append({"role": "assistant", "content": draw(_TEXT)})
        messages.append({"role": "user", "content": draw(_TEXT)})
    return messages


def test_the_direct_path_is_taken(chat_tokenizer: ChatTokenizer) -> None:
    direct = chat_tokenizer._direct
    assert direct is not None  # both templates pass the start-up probes
    assert direct.render([{"role": "user", "content": "x"}], add_generation_prompt=True)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=chats(), add=st.booleans(), thinking=st.none() | st.booleans())
def test_plain_chats_render_as_transformers_does(
    chat_tokenizer: ChatTokenizer,
    messages: list[dict[str, str]],
    add: bool,
    thinking: bool | None,
) -> None:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    got = chat_tokenizer.render(messages, add_generation_prompt=add, **kwargs)
    assert got == _transformers(chat_tokenizer, messages, add=add, **kwargs)


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        # a reasoning field, which transformers aliases before rendering
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "because"},
                {"role": "user", "content": "again"},
            ],
            {},
        ),
        # tools, which transformers normalizes
        (
            [{"role": "user", "content": "weather?"}],
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "get", "parameters": {"type": "object"}},
                    }
                ]
            },
        ),
        # a None value (transformers drops the key) and a non-scalar keyword
        ([{"role": "user", "content": "hi", "name": None}], {}),
        ([{"role": "user", "content": "hi"}], {"extra": {"nested": 1}}),
    ],
)
def test_other_calls_go_through_transformers(
    chat_tokenizer: ChatTokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> None:
    direct = chat_tokenizer._direct
    assert direct is not None
    assert direct.render(messages, add_generation_prompt=True, **kwargs) is None
    assert chat_tokenizer.render(messages, **kwargs) == _transformers(
        chat_tokenizer, messages, **kwargs
    )


def test_a_template_that_differs_on_the_probes_is_declined(chat_tokenizer: ChatTokenizer) -> None:
    class Skewed:
        """apply_chat_template disagrees with the compiled template (a wrapper that changed)."""

        special_tokens_map = chat_tokenizer.tokenizer.special_tokens_map

        def get_chat_template(self) -> str:
            return chat_tokenizer.tokenizer.get_chat_template()

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            return "changed " + chat_tokenizer.tokenizer.apply_chat_template(messages, **kwargs)

    assert DirectTemplate.load(Skewed()) is None


def test_remembered_safety_answers_still_refuse_what_the_sandbox_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jinja2.exceptions import SecurityError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from gateway.text import chat_template

    source = (
        "{% for m in messages %}{{ loop.first }}{{ m|attr(m['role']) }}{% endfor %}"
        "{% if tools == 'append' %}{{ messages.append(1) }}{% endif %}"
    )
    template = _compile_jinja_template(source)
    chat_template._remember_safety(template.environment)
    env = template.environment
    assert "is_safe_attribute" in vars(env)  # the stock sandbox gets the remembered answers
    for _ in range(2):  # asked, then remembered: the same answers
        assert template.render(messages=[{"role": "keys", "content": ""}]).startswith("True")
        assert "builtin_function" not in template.render(messages=[{"role": "__class__"}])
        with pytest.raises(SecurityError):
            template.render(messages=[], tools="append")  # a list mutation
    # Attribute names read from request data cannot grow the answers without bound.
    monkeypatch.setattr(chat_template, "_SAFETY_ANSWERS_MAX", 5)
    names = ["get", "items", "values", "copy", "fromkeys", "popitem"]
    template.render(messages=[{"role": name} for name in names])
    remembered = env.is_safe_attribute.__closure__
    sizes = [len(c.cell_contents) for c in remembered if isinstance(c.cell_contents, dict)]
    assert sizes == [5]
