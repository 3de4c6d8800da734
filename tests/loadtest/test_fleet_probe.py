"""fleet_probe's gateway counters: what the index predicted against what the workers reported."""

from __future__ import annotations

import math

from loadtest.fleet_probe import gateway_figures, parse_gateway_counters

ONE = """# HELP kvroute_gateway_requests_total Requests routed
kvroute_gateway_requests_total{reason="cache",worker_id="w1"} 5.0
kvroute_gateway_requests_total{worker_id="w2",reason="load"} 2.0
kvroute_gateway_prompt_tokens_total{worker_id="w1"} 1000.0
kvroute_gateway_predicted_cached_tokens_total{worker_id="w1"} 400.0
kvroute_gateway_cached_tokens_total{worker_id="w1"} 300.0
kvroute_gateway_requests_created{reason="cache",worker_id="w1"} 1.7e9
"""


def test_replicas_counters_add_up_and_give_rates_over_a_run() -> None:
    before = parse_gateway_counters(ONE, {})
    after = parse_gateway_counters(ONE, parse_gateway_counters(ONE, {}))  # two replicas
    after = parse_gateway_counters(ONE, after)  # ... and one more run's worth
    assert after["prompt_tokens"] == 3000.0 and after["requests:cache"] == 15.0
    figures = gateway_figures(before, after)
    assert figures["predicted_hit_rate"] == 0.4 and figures["reported_hit_rate"] == 0.3
    assert figures["reasons"] == {"cache": 10, "load": 4}
    assert math.isnan(gateway_figures(before, before)["predicted_hit_rate"])  # no traffic
