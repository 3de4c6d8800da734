"""bench_overhead's cold workload is cold: no two requests share a prefix past the template's."""

from __future__ import annotations

import json

from loadtest.bench_overhead import _sendable, make_bodies


def _system(body: bytes) -> str:
    content = json.loads(body)["messages"][0]["content"]
    assert isinstance(content, str)
    return content


def test_cold_bodies_never_repeat_even_when_the_list_cycles() -> None:
    bodies = make_bodies("chat_6k_cold", 3, seed=1)
    sent = [_sendable(bodies[i % len(bodies)]) for i in range(9)]
    firsts = [_system(b).split(" ", 1)[0] for b in sent]
    assert len(set(firsts)) == 9  # a fresh number leads every system prompt
    assert all(f.isdigit() for f in firsts)


def test_repeated_bodies_are_sent_unchanged() -> None:
    (body,) = make_bodies("chat_6k_repeat", 3, seed=1)
    assert _sendable(body) == body
