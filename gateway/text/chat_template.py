"""The chat template rendered straight from its compiled Jinja, for plain messages.

``apply_chat_template`` spends more time preparing a call than rendering it:
it rebuilds every message out of plain JSON types (a sandbox measure for the
rich objects Python callers pass), drops ``None`` values and aliases
reasoning fields. On ``loadtest.bench_overhead``'s 24-message 6k-token chat
that is 100 of its 170 us, on a two-message chat 17 of 31. Messages parsed
from a request's JSON are plain already, so for them the gateway calls the
same compiled template with the same variables (the tokenizer's special
tokens, then the request's ``chat_template_kwargs``), which renders the same
text. Anything else — tools, a reasoning field, a value that is not a
string, a keyword that is not a scalar — goes through ``apply_chat_template``.

The sandbox stays: transformers compiles templates in jinja's immutable
sandbox, which asks ``is_safe_attribute`` on every attribute a template reads
(``loop.first`` once a message, through ``isinstance`` checks against
abstract classes). Its answer depends only on the object's type and the
attribute's name, so ``_remember_safety`` keeps it per (type, name): the
24-message chat renders in 43 instead of 70 us.

``DirectTemplate.load`` renders probe conversations both ways and declines
(the gateway then always calls ``apply_chat_template``) if they differ or if
transformers no longer offers the compiler it uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Fields transformers rewrites before rendering (``_alias_reasoning_fields``).
_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})
_SCALARS = (str, int, float, bool)
# Names the renderer sets itself: a request's keyword with one of them takes the slow path.
_OWN_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Whitespace and multi-byte text next to the message markers, where a difference (or,
# for ``gateway.text.tokenizer``'s split checks, a merge across them) would show.
PROBE_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "  sys  "},
    {"role": "user", "content": "héllo \n\n"},
    {"role": "assistant", "content": " 世界 ok.\n"},
    {"role": "user", "content": "\t<b>x</b> "},
]
_PROBES = [[{"role": "user", "content": "hi"}], PROBE_CHAT]
# (type, attribute) answers kept per environment; a template reading attribute names
# from request data (jinja's ``attr`` filter) cannot grow it past this.
_SAFETY_ANSWERS_MAX = 4096


class DirectTemplate:
    """The tokenizer's default chat template, compiled once, rendered without the wrapper."""

    def __init__(self, template: Any, variables: Mapping[str, Any]) -> None:
        self._template = template
        self._variables = dict(variables)

    @classmethod
    def load(cls, tokenizer: Any) -> DirectTemplate | None:
        """The direct renderer for ``tokenizer``, or None where it would not match."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            template = _compile_jinja_template(tokenizer.get_chat_template())
            _remember_safety(template.environment)
            direct = cls(template, tokenizer.special_tokens_map)
            for messages in _PROBES:
                for add in (True, False):
                    expected = tokenizer.apply_chat_template(
                        messages, add_generation_prompt=add, tokenize=False
                    )
                    if direct.render(messages, add_generation_prompt=add) != expected:
                        logger.info("chat template: rendered through transformers (probe differs)")
                        return None
        except Exception as exc:  # no template, or transformers moved its compiler
            logger.info("chat template: rendered through transformers (%s)", exc)
            return None
        return direct

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        **template_kwargs: Any,
    ) -> str | None:
        """The rendered chat, or None when the call needs ``apply_chat_template``'s preparation."""
        if not _plain(messages) or template_kwargs.keys() & _OWN_NAMES:
            return None
        if not all(type(v) in _SCALARS for v in template_kwargs.values()):
            return None
        text = self._template.render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self._variables, **template_kwargs},
        )
        return text if isinstance(text, str) else None


def _plain(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every message is a dict of strings with no field transformers rewrites."""
    for m in messages:
        if type(m) is not dict:
            return False
        for key, value in m.items():
            if type(value) is not str or key in _REASONING_FIELDS:
                return False
    return True


def _remember_safety(env: Any) -> None:
    """Keeps a stock jinja sandbox's ``is_safe_attribute`` answers per (type, name).

    Jinja's own checks (a leading underscore, a function's or frame's internals,
    a method that mutates a list, dict, set or deque) look at nothing but the
    object's type and the name: exact for every object a template can reach
    (JSON values and jinja's own runtime objects). An environment whose class
    answers otherwise is left alone. transformers caches its compiled templates,
    so its own ``apply_chat_template`` calls share the remembered answers.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    stock = (
        SandboxedEnvironment.is_safe_attribute,
        ImmutableSandboxedEnvironment.is_safe_attribute,
    )
    if type(env).is_safe_attribute not in stock or "is_safe_attribute" in vars(env):
        return
    ask: Callable[[Any, str, Any], bool] = env.is_safe_attribute
    answers: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = answers.get(key)
        if safe is None:
            safe = ask(obj, attr, value)
            if len(answers) < _SAFETY_ANSWERS_MAX:
                answers[key] = safe
        return safe

    env.is_safe_attribute = is_safe_attribute
