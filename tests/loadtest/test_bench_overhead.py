"""bench_overhead: the cold workload is cold (no two requests share a prefix past the
template's), and its baseline router comes with a checkout to run it from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench_overhead import ROOT, ROUTERS, _router_cmd, _sendable, main, make_bodies
from loadtest.instant_workers import http_namespace


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


def test_the_baseline_router_needs_a_kvroute_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="go together"):
        main(["--routers", "kvroute,kvroute_baseline"])
    with pytest.raises(SystemExit, match="go together"):
        main(["--routers", "kvroute", "--baseline-tree", str(ROOT)])
    with pytest.raises(SystemExit, match="not a kvroute checkout"):
        main(["--routers", "kvroute_baseline", "--baseline-tree", str(tmp_path)])
    # The default routers leave the baseline out, so a plain run needs no tree.
    assert "kvroute_baseline" in ROUTERS
    cmd = _router_cmd("kvroute_baseline", 1, "redis://x", "ns", [])
    assert cmd == _router_cmd("kvroute", 1, "redis://x", "ns", [])
    with pytest.raises(SystemExit, match="go together"):
        main(["--routers", "kvroute_http,kvroute_http_baseline"])
    # The vLLM-shaped fakes' gateway (and its baseline) routes in their own namespace.
    http = _router_cmd("kvroute_http_baseline", 1, "redis://x", "ns", [])
    assert http == _router_cmd("kvroute_http", 1, "redis://x", "ns", [])
    assert http[http.index("--redis-namespace") + 1] == http_namespace("ns") != "ns"


def test_workloads_and_concurrency_are_checked_and_json_256_is_one_whole_answer() -> None:
    with pytest.raises(SystemExit, match="is not one of"):
        main(["--routers", "kvroute", "--workloads", "chat_tiny"])
    with pytest.raises(SystemExit, match="--concurrency 0"):
        main(["--routers", "kvroute", "--concurrency", "0"])
    (body,) = make_bodies("json_256", 3, seed=1)
    sent = json.loads(body)
    assert (sent["max_tokens"], sent.get("stream", False)) == (256, False)
    assert "stop" not in sent and "tools" not in sent  # an answer the gateway reads whole
