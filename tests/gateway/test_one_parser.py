"""One OpenAI parser: the gateway's edge and a worker's own HTTP front judge a body alike.

The same bodies go to a real gateway (fake gRPC workers behind it) and to a
real worker's HTTP front (a real engine on a tiny model); each answer's status
and the parameter an error names must agree.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.conftest import MODEL, Harness
from tests.worker.server_stack import (  # noqa: F401 (fixtures)
    Stack,
    stack,
    stack_runner,
    stack_tokenizer,
)

CHAT = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

BODIES: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": CHAT, "max_tokens": 2}),
    ("chat", {"messages": CHAT, "max_tokens": 2, "top_p": 0}),
    ("chat", {"messages": CHAT, "max_tokens": 2, "top_k": -1, "stop_token_ids": [5]}),
    ("chat", {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"x": 1}}),
    ("chat", {"messages": CHAT, "temperature": 2.5}),
    ("chat", {"messages": CHAT, "top_p": 1.5}),
    ("chat", {"messages": CHAT, "n": 2}),
    ("chat", {"messages": CHAT, "max_tokens": 0}),
    ("chat", {"messages": CHAT, "stop": [1]}),
    ("chat", {"messages": CHAT, "stream_options": "yes"}),
    ("chat", {"messages": CHAT, "chat_template_kwargs": []}),
    ("chat", {"messages": CHAT, "cache_salt": 3}),
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat", {"messages": [{"role": "user", "content": None}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("chat", {"messages": CHAT, "max_tokens": 2, "tools": [TOOL]}),
    ("chat", {"messages": CHAT, "max_tokens": 2, "tools": [TOOL], "tool_choice": "none"}),
    ("chat", {"messages": CHAT, "max_tokens": 2, "tools": [{"type": "function"}]}),
    ("chat", {"messages": CHAT, "tools": [TOOL], "tool_choice": "always"}),
    ("chat", {"messages": CHAT, "tool_choice": "required"}),
    ("chat", {"messages": [*CHAT, {"role": "tool", "content": "x"}]}),
    ("chat", {"messages": [*CHAT, {"role": "assistant", "tool_calls": "x"}]}),
    ("completion", {"prompt": "hello", "max_tokens": 2}),
    ("completion", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("completion", {"prompt": ""}),
    ("completion", {"prompt": [1, -2]}),
    ("completion", {"prompt": ["a", "b"]}),
    ("completion", {"prompt": "x", "seed": "s"}),
    ("completion", {"prompt": "x", "stop_token_ids": "5"}),
]


async def _verdict(post: Any, body: dict[str, Any]) -> tuple[int, str | None]:
    resp = await post(body)
    data = await resp.json()
    return resp.status, (data.get("error") or {}).get("param") if resp.status != 200 else None


@pytest.mark.parametrize(("kind", "body"), BODIES, ids=[str(i) for i in range(len(BODIES))])
async def test_gateway_and_worker_front_agree(
    gateway: Harness,
    stack: Stack,  # noqa: F811
    kind: str,
    body: dict[str, Any],
) -> None:
    await gateway.add_worker("a", "fine")
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    async def to_gateway(b: dict[str, Any]) -> Any:
        return await gateway.client.post(path, json={"model": MODEL, **b})

    async def to_worker(b: dict[str, Any]) -> Any:
        return await stack.http.post(path, json={"model": stack.model, **b})

    ours, theirs = await _verdict(to_gateway, body), await _verdict(to_worker, body)
    assert ours == theirs, f"gateway {ours} vs worker {theirs} for {body}"
