"""Chat messages of an OpenAI body, as the chat template receives them.

``parse_messages`` checks roles and content (text only: a string or a list of
text parts) and keeps an assistant's ``tool_calls`` (``arguments`` decoded from
their JSON string, as vLLM passes them) and a tool message's ``tool_call_id``;
anything else is an ``APIError(400)`` naming the message and field.
"""

from __future__ import annotations

import json
from typing import Any

from openai_api.body_fields import bad_value

MAX_MESSAGES = 4096  # per chat request: parsing and templating stay short on the loop
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_value("only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_value("message content must be a string or a list of text parts", where)


def parse_messages(raw: Any) -> tuple[dict[str, Any], ...]:
    """Chat messages as the chat template receives them: ``{"role", "content": str}``, plus
    an assistant's ``tool_calls`` and a tool message's ``tool_call_id``."""
    if not isinstance(raw, list) or not raw:
        raise bad_value("'messages' must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise bad_value(f"at most {MAX_MESSAGES} messages", "messages")
    messages = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_value("each message must be an object", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad_value(f"'role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
        content = msg.get("content")
        calls = msg.get("tool_calls") if role == "assistant" else None
        if content is None and role != "assistant":
            raise bad_value(f"a {role} message needs 'content'", f"{where}.content")
        text = "" if content is None else _content_text(content, f"{where}.content")
        # Passed to the template exactly as the worker's own front passes it, so ids match.
        message: dict[str, Any] = {"role": role, "content": text}
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_value("a tool message needs 'tool_call_id'", f"{where}.tool_call_id")
            message["tool_call_id"] = call_id
        messages.append(message)
    return tuple(messages)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates take them: ``arguments`` decoded
    from its JSON string to an object where it is one (as vLLM passes them)."""
    if not isinstance(raw, list):
        raise bad_value("'tool_calls' must be a list", where)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise bad_value(
                "a tool call is {id, type: function, function: {name, arguments: string}}",
                f"{where}[{j}]",
            )
        try:
            arguments: Any = json.loads(fn["arguments"])
        except ValueError:
            arguments = fn["arguments"]
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return calls
