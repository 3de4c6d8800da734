"""bench_overhead: the cold workload is cold (no two requests share a prefix past the
template's), and its baseline router comes with a checkout to run it from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench_overhead import (
    ROOT,
    ROUTERS,
    _router_cmd,
    _sendable,
    main,
    make_bodies,
    summarize,
)
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


def _rows(cpu: float, rps: float, p50_c1: float) -> list[dict[str, float]]:
    row = {"cpu_ms_per_request": cpu, "max_rps": rps, "p50_ms": 5.0, "p99_ms": 9.0}
    return [{**row, "p50_ms_c1": p50_c1, "cores_used": 1.0, "errors": 0}]


def test_targets_of_workloads_left_out_are_null_and_target_met_needs_all_six() -> None:
    direct = {"chat_small": 0.3, "stream_128": 0.3, "chat_6k_repeat": 0.4, "chat_6k_cold": 0.5}
    good = {
        "chat_small": _rows(0.4, 3000.0, 1.0),
        "stream_128": _rows(1.0, 900.0, 0.8),
        "chat_6k_repeat": _rows(0.9, 1000.0, 0.9),
        "chat_6k_cold": _rows(4.0, 250.0, 1.0),
    }
    peer = {w: _rows(0.1, 6000.0, 0.5) for w in good}
    routers: dict[str, Any] = {"kvroute": None, "sglang_rr": None}  # started: only names read

    only_small = summarize(
        {"kvroute": {"chat_small": good["chat_small"]}, "sglang_rr": peer},
        routers,
        {},
        direct,
        ["chat_small"],
    )
    met = only_small["targets_met"]
    assert met["chat_small_cpu_ms_per_request <= 0.5"] is True
    assert met["chat_small_rps_vs_sglang_rr >= 0.25"] is True
    assert met["chat_small_added_p50_ms_c1 <= 0.5"] is False  # 1.0 - 0.3 ms
    assert met["chat_6k_repeat_cpu_ms_per_request <= 1.0"] is None
    assert met["cpu_ms_per_streamed_token <= 0.02"] is None
    assert only_small["target_met"] is False

    fast_c1 = {**good, "chat_small": _rows(0.4, 3000.0, 0.7)}  # 0.4 ms added
    full = summarize(
        {"kvroute": fast_c1, "sglang_rr": peer},
        routers,
        {},
        direct,
        list(good),
    )
    assert all(v is True for v in full["targets_met"].values()), full["targets_met"]
    assert full["target_met"] is True
