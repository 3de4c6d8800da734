"""The fleet simulator: exact time model, event lag, baselines, and a trace run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from contract.hashing import HashSpec
from loadtest.baselines import Chwbl, SglangLike
from loadtest.fleetsim import FleetSimulation, SimConfig, ideal_hit_rate
from loadtest.mooncake_trace import TraceChains, TraceTokens, load_trace
from loadtest.simulate import router_options, run_policy
from loadtest.workloads import RequestShape

ROOT = Path(__file__).resolve().parents[2]
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_head500.jsonl"


def shape(rid: str, t: float, keys: tuple[int, ...], prompt: int, out: int = 11) -> RequestShape:
    return RequestShape(
        request_id=rid, arrival_s=t, prompt_tokens=prompt, output_tokens=out, block_keys=keys
    )


# One worker, exact time model: 1,000 prefill tokens/s, 0.1 s a decode step, no lag.
ONE_WORKER = SimConfig(
    workers=1,
    block_size=100,
    capacity_tokens=1000,
    prefill_tokens_per_s=1000.0,
    decode_step_s=0.1,
    event_delay_s=0.0,
    heartbeat_s=0.0,
)


def test_ttft_is_queue_wait_plus_uncached_prefill() -> None:
    cfg = ONE_WORKER
    a = shape("a", 0.0, (1, 2), 250)
    b = shape("b", 0.5, (1, 2, 3), 320)
    ra, rb = FleetSimulation(cfg).run([a, b])
    assert ra.cached_tokens == 0 and ra.ttft_s == pytest.approx(0.25)
    assert ra.finish_s == pytest.approx(0.25 + 10 * 0.1)
    # b arrives after a's prefill: blocks 1, 2 hit, 120 tokens left.
    assert rb.cached_tokens == 200 and rb.ttft_s == pytest.approx(0.12)
    c = shape("c", 0.0, (1, 2), 200)
    d = shape("d", 0.0, (1, 2), 200)
    rc, rd = FleetSimulation(cfg).run([c, d])
    # d queues behind c, then finds everything cached but its last token.
    assert rc.ttft_s == pytest.approx(0.2)
    assert rd.cached_tokens == 199 and rd.ttft_s == pytest.approx(0.2 + 0.001)


def test_a_worker_reports_its_prefill_rate_once_it_has_prefilled() -> None:
    # As an engine's RateMeter does: 0 (unknown) until a prefill has been timed, and
    # with heartbeats, only from the next heartbeat on.
    for heartbeat_s in (0.0, 1.0):
        sim = FleetSimulation(replace(ONE_WORKER, heartbeat_s=heartbeat_s))
        view = sim.gateways[0]
        assert sim.worker_state(view, "w0", 0, now=0.0).prefill_tokens_per_s == 0.0
        sim.run([shape("a", 0.0, (1, 2), 250)])
        assert sim.worker_state(view, "w0", 0, now=9.0).prefill_tokens_per_s == 1000.0


def test_a_full_batch_holds_the_next_prefill_until_a_sequence_finishes() -> None:
    cfg = replace(ONE_WORKER, max_num_seqs=1)
    a = shape("a", 0.0, (1, 2), 250)  # prefill 0.25 s, then 10 decode steps: done at 1.25 s
    b = shape("b", 0.0, (7, 8), 250)
    ra, rb = FleetSimulation(cfg).run([a, b])
    assert ra.ttft_s == pytest.approx(0.25)
    assert rb.start_s == pytest.approx(1.25) and rb.ttft_s == pytest.approx(1.5)
    # without the cap b's prefill follows a's at once
    free = FleetSimulation(replace(cfg, max_num_seqs=0)).run([a, b])
    assert free[1].ttft_s == pytest.approx(0.5)


def test_router_view_lags_by_the_event_delay() -> None:
    cfg = SimConfig(
        workers=2,
        block_size=10,
        capacity_tokens=100,
        prefill_tokens_per_s=100.0,
        event_delay_s=1.0,
        speculative_ttl_s=0.0,
        heartbeat_s=0.0,
    )
    sim = FleetSimulation(cfg)
    recs = sim.run(
        [
            shape("a", 0.0, (1, 2), 20, out=1),
            shape("b", 0.5, (1, 2), 20, out=1),
            shape("c", 5.0, (1, 2), 20, out=1),
        ]
    )
    assert [r.predicted_cached_tokens for r in recs] == [0, 0, 20]
    assert recs[2].worker == recs[0].worker and recs[2].cached_tokens == 19


def test_speculation_holds_until_the_first_token_then_the_grace() -> None:
    # Both workers are busy for 10 s, so "a" queues; "b" arrives at 5 s, past a 1 s
    # grace, and still finds "a"'s chain held on a's worker. After a's first token
    # only the grace is left.
    cfg = SimConfig(
        workers=2,
        block_size=10,
        capacity_tokens=10_000,
        prefill_tokens_per_s=100.0,
        event_delay_s=100.0,  # no real event lands during the test
        speculative_ttl_s=1.0,
        heartbeat_s=0.0,
    )
    sim = FleetSimulation(cfg)
    chain = tuple(range(1, 21))
    recs = sim.run(
        [
            shape("x0", 0.0, (101,), 1000, out=1),
            shape("x1", 0.0, (102,), 1000, out=1),
            shape("a", 0.1, chain, 200, out=1),
            shape("b", 5.0, chain, 200, out=1),
        ]
    )
    _, _, a, b = recs
    assert a.start_s is not None and a.start_s >= 10.0  # it queued behind a busy worker
    assert b.worker == a.worker and b.predicted_cached_tokens == 200
    # (The run ends after the late real events too: count the speculative pairs alone.)
    index = sim.gateways[0].index
    index.prune(a.arrival_s + a.ttft_s + 0.5)
    assert index.speculative_count() == 20  # held: the grace, and b waiting
    index.prune(b.arrival_s + b.ttft_s + 1.5)
    assert index.speculative_count() == 0


def test_multi_turn_follows_after_the_previous_answer() -> None:
    cfg = SimConfig(
        workers=1, block_size=10, capacity_tokens=100, prefill_tokens_per_s=100.0, decode_step_s=0.5
    )
    t0 = shape("t0", 0.0, (1,), 10, out=3)
    t1 = RequestShape("t1", 0.0, 25, 2, (1, 2), session="s", turn=1, after="t0", think_s=2.0)
    r0, r1 = FleetSimulation(cfg).run([t1, t0])
    assert r0.finish_s == pytest.approx(0.1 + 1.0)
    assert r1.arrival_s == pytest.approx(3.1)


def test_ideal_is_one_unlimited_cache_in_arrival_order() -> None:
    cfg = SimConfig(workers=2, block_size=10, capacity_tokens=10, policy="round_robin")
    recs = FleetSimulation(cfg).run(
        [shape("a", 0, (1, 2), 25), shape("b", 1, (1, 2, 3), 35), shape("c", 2, (9,), 10)]
    )
    assert ideal_hit_rate(recs, 10) == pytest.approx(20 / 70)


def test_chwbl_is_sticky_until_the_bound() -> None:
    ring = Chwbl(["w0", "w1", "w2"], load_factor=1.25)
    loads = {"w0": 0, "w1": 0, "w2": 0}
    first = ring.choose(12345, loads)
    assert ring.choose(12345, loads) == first
    loads[first] = 2  # bound = ceil(1.25 * 3 / 3) = 2: the owner is full, the next one takes it
    assert ring.choose(12345, loads) != first


def test_sglang_like_threshold_and_imbalance() -> None:
    sg = SglangLike(["w0", "w1"], cache_threshold=0.5, balance_abs=2, balance_rel=1.5)
    loads = {"w0": 0, "w1": 0}
    assert sg.choose([1, 2, 3, 4], 40, 10, loads) == ("w0", "fallback", 0)  # smallest tree
    assert sg.choose([7, 8], 20, 10, loads) == ("w1", "fallback", 0)
    assert sg.choose([1, 2, 3, 5], 40, 10, loads) == ("w0", "cache", 3)  # 75% > 50%
    assert sg.choose([1, 9, 9, 9], 40, 10, loads)[1] == "fallback"  # 25% match only
    assert sg.choose([1, 2, 3, 4], 40, 10, {"w0": 5, "w1": 0})[:2] == ("w1", "load")


def test_kvroute_beats_round_robin_on_the_trace_head() -> None:
    shapes = list(TraceChains(HashSpec(block_size=512)).shapes(load_trace(TRACE, limit=500)))
    base = {"workers": 8, "block_size": 512, "capacity_tokens": 3_000_000}
    kv = run_policy(SimConfig(policy="kvroute", **base), shapes, progress=False)
    rr = run_policy(SimConfig(policy="round_robin", **base), shapes, progress=False)
    assert kv["requests"] == rr["requests"] == 500
    assert kv["ideal_hit_rate"] == rr["ideal_hit_rate"] > 0.1
    assert kv["hit_rate"] > rr["hit_rate"] + 0.05
    assert kv["load_cov"] < 0.5


def test_cli_prints_one_json_object() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.simulate",
            "--trace",
            str(TRACE),
            "--limit",
            "200",
            "--block-size",
            "512",
            "--workers",
            "4",
            "--capacity-tokens",
            "3000000",
            "--policy",
            "chwbl",
            "--json",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)
    for key in (
        "policy",
        "requests",
        "hit_rate",
        "ideal_hit_rate",
        "load_cov",
        "ttft_p50_s",
        "ttft_p99_s",
    ):
        assert key in result
    assert result["policy"] == "chwbl" and result["requests"] == 200


def test_router_options_are_typed_and_checked() -> None:
    assert router_options(["balance_factor=2.5", "decode-weight-s=0"]) == (
        ("balance_factor", 2.5),
        ("decode_weight_s", 0.0),
    )
    with pytest.raises(ValueError, match="--router"):
        router_options(["no_such_knob=1"])


@pytest.mark.parametrize(
    ("running", "waiting", "queued", "finished", "pending"),
    [(3, 2, 500, 0, 0), (3, 2, 500, 1, 0), (3, 2, 500, 4, 0), (1, 0, 90, 1, 40), (0, 0, 0, 0, 70)],
)
def test_simulator_sees_load_exactly_as_the_dispatcher(
    running: int, waiting: int, queued: int, finished: int, pending: int
) -> None:
    """Same heartbeat, same finishes since, same pending work: the same ``WorkerState``."""
    from contract.redis_layout import RedisLayout, WorkerRecord
    from gateway.routing.index import BlockIndex
    from gateway.routing.mirror import IndexMirror
    from gateway.routing.mirror_state import WorkerEntry
    from loadtest.scale_dispatcher import standalone_dispatcher

    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    record = WorkerRecord(
        worker_id="w0",
        address="127.0.0.1:1",
        running=running,
        waiting=waiting,
        queued_prefill_tokens=queued,
        prefill_tokens_per_s=1000.0,
        updated_at=123.0,
    )
    entry = WorkerEntry(record=record, spec=HashSpec(10, "m"), loaded=True)
    dispatcher = standalone_dispatcher(
        mirror, index, speculative_ttl_s=0.0, request_timeout_s=1.0, max_retries=0
    )
    dispatcher.state(entry, 0)  # the gateway sees this heartbeat ...
    load = dispatcher.loads["w0"]
    load.finished += finished  # ... then sees requests finish ...
    load.pending_prefill_tokens = pending  # ... and has work not yet started there
    ours = dispatcher.state(entry, 2)

    sim = FleetSimulation(SimConfig(workers=1, block_size=10, heartbeat_s=1.0))
    view = sim.gateways[0]
    sim.snapshot["w0"] = (running, waiting, queued, 0)
    view.finished_at["w0"] = [1.0] * finished
    view.pending_prefill["w0"] = pending
    theirs = sim.worker_state(view, "w0", 2, now=5.0)
    for field_name in ("running", "waiting", "queued_prefill_tokens", "cached_blocks"):
        assert getattr(ours, field_name) == getattr(theirs, field_name), field_name


def test_replicas_hear_what_the_others_routed_replica_lag_later() -> None:
    cfg = SimConfig(
        workers=2,
        block_size=10,
        capacity_tokens=10_000,
        prefill_tokens_per_s=100.0,
        event_delay_s=100.0,  # no real event lands during the test: only what replicas share
        heartbeat_s=0.0,
        replicas=2,
        replica_lag_s=1.0,
    )
    chain = tuple(range(1, 21))
    # Requests go to the replicas in turn: a, c at the first; b, d at the second.
    a, b, c, d = FleetSimulation(cfg).run(
        [
            shape("a", 0.0, chain, 200, out=1),
            shape("b", 0.5, chain, 200, out=1),  # before a's route reaches its replica
            shape("c", 0.6, chain, 200, out=1),
            shape("d", 1.5, chain, 200, out=1),  # after
        ]
    )
    assert a.gateway is c.gateway and b.gateway is d.gateway and a.gateway is not b.gateway
    assert b.predicted_cached_tokens == 0
    assert c.predicted_cached_tokens == d.predicted_cached_tokens == 200
    assert c.worker == a.worker


def test_three_replicas_spread_a_burst_as_one_gateway_does(tmp_path: Path) -> None:
    # The trace's requests come in bursts at one timestamp, which replicas route before
    # they hear each other: each breaking ties in its own share of the fleet keeps them
    # off one worker (without it, mean TTFT 1.47x one gateway's on this fleet).
    from loadtest.aiperf_client import rescale_trace

    rescaled = tmp_path / "rescaled.jsonl"
    rescale_trace(TRACE, rescaled, block_tokens=32, limit=500)
    records = load_trace(rescaled, limit=500, time_scale=1 / 8)
    shapes = list(
        TraceChains(HashSpec(block_size=16), TraceTokens(block_tokens=32)).shapes(records)
    )
    fleet = SimConfig(
        workers=16,
        block_size=16,
        capacity_tokens=32_768,
        prefill_tokens_per_s=33_875.0,
        prefill_step_s=0.006,
        decode_step_s=0.0066,
        event_delay_s=0.01,
        heartbeat_s=0.5,
    )
    one = run_policy(fleet, shapes, progress=False)
    three = run_policy(replace(fleet, replicas=3), shapes, progress=False)
    assert three["hit_rate"] >= one["hit_rate"] - 0.005
    assert three["ttft_mean_s"] <= 1.1 * one["ttft_mean_s"]
