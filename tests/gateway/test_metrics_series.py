"""``GatewayMetrics.worker``: per-worker children made once, counting into the same series."""

from __future__ import annotations

from gateway.observe.metrics import GatewayMetrics


def _value(m: GatewayMetrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_worker_series_count_into_the_labelled_series() -> None:
    m = GatewayMetrics()
    w = m.worker("w1")
    assert m.worker("w1") is w  # made once
    w.requests("cache").inc()
    w.requests("cache").inc()
    w.requests("load").inc()
    w.prompt_tokens.inc(100)
    w.cached_tokens.inc(64)
    w.ttft_seconds.observe(0.02)
    m.worker("w2").generation_tokens.inc(7)
    assert _value(m, "kvroute_gateway_requests_total", worker_id="w1", reason="cache") == 2
    assert _value(m, "kvroute_gateway_requests_total", worker_id="w1", reason="load") == 1
    assert _value(m, "kvroute_gateway_prompt_tokens_total", worker_id="w1") == 100
    assert _value(m, "kvroute_gateway_cached_tokens_total", worker_id="w1") == 64
    assert _value(m, "kvroute_gateway_ttft_seconds_count", worker_id="w1") == 1
    assert _value(m, "kvroute_gateway_generation_tokens_total", worker_id="w2") == 7
    assert _value(m, "kvroute_gateway_generation_tokens_total", worker_id="w1") == 0


def test_forgetting_a_worker_keeps_its_counters_valid() -> None:
    m = GatewayMetrics()
    w = m.worker("w1")
    w.prompt_tokens.inc(5)
    m.forget_worker("w1")  # drops its gauges only
    m.worker("w1").prompt_tokens.inc(5)
    assert _value(m, "kvroute_gateway_prompt_tokens_total", worker_id="w1") == 10
