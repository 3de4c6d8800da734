"""Function calling: ``tools`` and ``tool_choice``, the grammar a forced call follows, and
tool calls read back out of the model's text.

The tools go into the chat template (``apply_chat_template(tools=...)``) on every front,
so the gateway's token ids stay the worker's. What a call looks like is the template's
own format: ``hermes`` for templates that write ``<tool_call>{"name", "arguments"}
</tool_call>`` (Qwen, Hermes), else ``json``, a bare ``{"name", "arguments"}`` object.

``tool_choice`` ``required`` or a named function forces a call: the output is
constrained (llguidance) to one call in the template's format whose ``arguments``
follow the function's ``parameters`` schema. ``auto`` samples freely and parses calls
out of the text if the model wrote any; ``none`` is plain text. Parsing never fails
a request: text that is not a well-formed call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from openai_api.errors import APIError

HERMES = "hermes"
HERMES_TOKENS = "hermes-tokens"
JSON = "json"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Tools:
    """A request's functions (as the chat template takes them) and its ``tool_choice``."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, ...}}
    choice: str = "auto"  # "none" | "auto" | "required" | "function" (the one named)
    name: str | None = None  # the function ``tool_choice`` names

    @property
    def forced(self) -> bool:
        """The output must be a tool call (``required`` or a named function)."""
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """The output is read for tool calls (anything but ``none``)."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict(tool["function"].get("parameters") or EMPTY_PARAMETERS)
        raise KeyError(name)


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """``tools`` and ``tool_choice`` of a chat body; None when no tool is offered."""
    raw = body.get("tools")
    if raw is None or raw == []:
        tools: tuple[dict[str, Any], ...] = ()
    elif not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    else:
        tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("'tools' names a function twice", "tools")
    choice, name = _choice(body.get("tool_choice"), bool(tools))
    if name is not None and name not in names:
        raise _bad(f"'tool_choice' names '{name}', which is not in 'tools'", "tool_choice")
    return Tools(tools, choice, name) if tools else None


def _tool(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise _bad("each tool must be an object with 'type': 'function'", f"{where}.type")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise _bad("a tool needs a 'function' object", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(
            "a function name is 1 to 64 letters, digits, '_' or '-'", f"{where}.function.name"
        )
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise _bad("'description' must be a string", f"{where}.function.description")
        out["description"] = description
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _bad("'parameters' must be a JSON schema object", f"{where}.function.parameters")
        out["parameters"] = parameters
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("'strict' must be a boolean", f"{where}.function.strict")
    return {"type": "function", "function": out}


def _choice(raw: Any, have_tools: bool) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if have_tools else "none"), None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise _bad("'tool_choice' must be none, auto, required or a function", "tool_choice")
        if raw == "required" and not have_tools:
            raise _bad("'tool_choice' required needs 'tools'", "tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise _bad(
            "'tool_choice' must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not have_tools:
        raise _bad("'tool_choice' names a function but 'tools' is empty", "tool_choice")
    return "function", name


def tool_format(tokenizer: Any) -> str:
    """How the model writes a call: ``hermes`` when its chat template uses ``<tool_call>``
    (``hermes-tokens`` when the tags are tokens of their own, as in Qwen's vocabulary:
    the grammar must then name those tokens), else ``json``."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or CALL_OPEN not in template:
        return JSON
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return HERMES_TOKENS if CALL_OPEN in added and CALL_CLOSE in added else HERMES


# -- constrained output -----------------------------------------------------------------


def call_schema(tools: Tools) -> dict[str, Any]:
    """The JSON schema of one call a forced ``tool_choice`` allows."""
    names = [tools.name] if tools.name is not None else [t["function"]["name"] for t in tools.tools]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": tools.parameters(n)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def constraint(tools: Tools | None, fmt: str) -> tuple[str | None, str | None]:
    """(``json_schema``, ``grammar``) that force a call, both None when nothing is forced:
    the call's schema for the ``json`` format, else a llguidance Lark grammar (``hermes``:
    the call's JSON inside ``<tool_call>`` tags)."""
    if tools is None or not tools.forced:
        return None, None
    schema = call_schema(tools)
    if fmt == JSON:
        return json.dumps(schema), None
    # Compact JSON, as response_format's: a small model could spend its tokens on whitespace.
    body = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    if fmt == HERMES_TOKENS:  # llguidance names special tokens as <...>
        head, tail = CALL_OPEN + ' "\\n"', '"\\n" ' + CALL_CLOSE
    else:
        head, tail = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    return None, f"start: {head} call {tail}\ncall: %json {body}\n"


# -- parsing the output -----------------------------------------------------------------


def _call(raw: str) -> dict[str, Any] | None:
    """One OpenAI ``tool_calls`` entry from a call's JSON text, or None if it is not one."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": obj["name"], "arguments": text},
    }


def split_calls(text: str, fmt: str) -> tuple[str, list[dict[str, Any]]]:
    """``text`` without its tool calls (not stripped) and the calls, in order."""
    if fmt == JSON:
        call = _call(text.strip()) if text.strip().startswith("{") else None
        return ("", [call]) if call is not None else (text, [])
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    end = 0
    for m in _HERMES_CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        content.append(text[end : m.start()])
        calls.append(call)
        end = m.end()
    content.append(text[end:])
    return "".join(content), calls


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer; content None when only calls remain."""
    content, calls = split_calls(text, fmt)
    if not calls:
        return text, []
    return (content.strip() or None), calls


def call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as a stream delta's ``tool_calls`` (each whole, with its ``index``)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


class ToolCallStream:
    """Streamed text with tool calls held back: ``push`` returns the content that is
    safe to send now, ``finish`` the rest and the calls.

    Under ``auto`` text streams until something that may open a call (``<tool_call>``,
    or a ``json`` answer starting with ``{``); from there it is held to the end. A
    forced call holds everything.
    """

    def __init__(self, tools: Tools, fmt: str) -> None:
        self.tools = tools
        self.fmt = fmt
        self.text = ""
        self._sent = 0
        self.calls: list[dict[str, Any]] = []
        self._content = ""

    def push(self, delta: str) -> str:
        self.text += delta
        safe = self._safe_end()
        out, self._sent = self.text[self._sent : safe], max(self._sent, safe)
        return out

    def _safe_end(self) -> int:
        text = self.text
        if self.tools.forced:
            return self._sent
        if self.fmt == JSON:
            head = text.lstrip()
            return self._sent if not head or head.startswith("{") else len(text)
        at = text.find(CALL_OPEN, self._sent)
        if at >= 0:
            return at
        for k in range(min(len(CALL_OPEN) - 1, len(text) - self._sent), 0, -1):
            if text.endswith(CALL_OPEN[:k]):
                return len(text) - k
        return len(text)

    def finish(self) -> str:
        """The content not yet sent; ``calls`` holds the tool calls found."""
        content, self.calls = split_calls(self.text, self.fmt)
        self._content = content
        # The calls start after what was sent, so ``content`` begins with the sent text.
        rest = content[self._sent :].rstrip() if self.calls else self.text[self._sent :]
        self._sent = len(self.text)
        return rest

    def content(self) -> str | None:
        """The whole answer's content as a non-streamed message carries it (after ``finish``)."""
        if not self.calls:
            return self.text
        return self._content.strip() or None
