"""fleet_probe's gateway counters: what the index predicted against what the workers reported."""

from __future__ import annotations

import math

from loadtest.fleet_probe import (
    gateway_figures,
    parse_gateway_counters,
    parse_worker_ttft,
    worker_ttft_mean,
)

ONE = """# HELP kvroute_gateway_requests_total Requests routed
kvroute_gateway_requests_total{reason="cache",worker_id="w1"} 5.0
kvroute_gateway_requests_total{worker_id="w2",reason="load"} 2.0
kvroute_gateway_prompt_tokens_total{worker_id="w1"} 1000.0
kvroute_gateway_predicted_cached_tokens_total{worker_id="w1"} 400.0
kvroute_gateway_cached_tokens_total{worker_id="w1"} 300.0
kvroute_gateway_requests_created{reason="cache",worker_id="w1"} 1.7e9
kvroute_gateway_routing_seconds_bucket{le="0.001"} 4.0
kvroute_gateway_routing_seconds_sum 0.006
kvroute_gateway_routing_seconds_count 7.0
kvroute_gateway_ttft_seconds_sum{worker_id="w1"} 0.2
kvroute_gateway_ttft_seconds_count{worker_id="w1"} 5.0
kvroute_gateway_ttft_seconds_sum{worker_id="w2"} 0.1
kvroute_gateway_ttft_seconds_count{worker_id="w2"} 2.0
"""


def test_replicas_counters_add_up_and_give_rates_over_a_run() -> None:
    before = parse_gateway_counters(ONE, {})
    after = parse_gateway_counters(ONE, parse_gateway_counters(ONE, {}))  # two replicas
    after = parse_gateway_counters(ONE, after)  # ... and one more run's worth
    assert after["prompt_tokens"] == 3000.0 and after["requests:cache"] == 15.0
    figures = gateway_figures(before, after)
    assert figures["predicted_hit_rate"] == 0.4 and figures["reported_hit_rate"] == 0.3
    assert figures["reasons"] == {"cache": 10, "load": 4}
    # Means over the run, from the histograms' sums and counts (every worker's series).
    assert math.isclose(figures["routing_mean_s"], 0.012 / 14)
    assert math.isclose(figures["ttft_mean_s"], 0.6 / 14)
    assert math.isclose(gateway_figures(before, after, 2.0)["ttft_mean_s"], 0.3 / 14)
    assert math.isnan(gateway_figures(before, before)["predicted_hit_rate"])  # no traffic


WORKER = """# HELP kvroute_worker_ttft_seconds Engine-side time to first token.
kvroute_worker_ttft_seconds_bucket{worker_id="w1",le="0.005"} 1.0
kvroute_worker_ttft_seconds_count{worker_id="w1"} 4.0
kvroute_worker_ttft_seconds_sum{worker_id="w1"} 0.6
kvroute_worker_ttft_seconds_created{worker_id="w1"} 1.7e9
kvroute_worker_e2e_seconds_sum{worker_id="w1"} 9.0
"""


def test_engine_side_ttft_mean_over_a_run_in_emulated_units() -> None:
    before = parse_worker_ttft(WORKER)
    assert before == (0.6, 4.0)  # neither the bucket, the created stamp nor e2e
    after = (before[0] + 1.2, before[1] + 4.0)
    assert math.isclose(worker_ttft_mean(before, after), 0.3)
    assert math.isclose(worker_ttft_mean(before, after, time_scale=3.0), 0.1)
    assert math.isnan(worker_ttft_mean(before, before))
