"""The bridge's pure parts: vLLM /metrics parsing, rate estimates, CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.bridge.cli import config_from_args
from worker.bridge.engine_http import EngineLoad, RateMeter, parse_metrics

METRICS = Path(__file__).parent / "data" / "vllm_events" / "metrics.txt"


def test_vllm_metrics_recorded_from_a_95_block_pool() -> None:
    load = parse_metrics(METRICS.read_text())
    assert load.running == 0 and load.waiting == 0
    assert load.num_blocks == 96  # --num-gpu-blocks-override wins over num_gpu_blocks
    assert load.block_size == 32
    assert load.prompt_tokens == 174.0
    assert load.prefill_seconds == pytest.approx(1.8404165)
    assert load.free_blocks == 96


def test_metrics_sum_over_engines_and_tolerate_noise() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running x",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} NaN',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",num_gpu_blocks_override="None"} 1.0',
            "garbage line",
        ]
    )
    load = parse_metrics(text)
    assert (load.running, load.waiting, load.num_blocks, load.block_size) == (5, 0, 1000, 16)
    assert load.free_blocks == 750


def test_rate_meter_measures_uncached_prefill_per_busy_second() -> None:
    meter = RateMeter(alpha=0.5)
    meter.update(EngineLoad(prompt_tokens=100, prefill_seconds=1.0))
    assert meter.prefill_tokens_per_s == 0.0  # one scrape measures nothing
    meter.update(
        EngineLoad(prompt_tokens=1100, cached_prompt_tokens=500, prefill_seconds=2.0)
    )  # 500 uncached tokens in 1 s of prefill
    assert meter.prefill_tokens_per_s == 500.0
    meter.update(
        EngineLoad(prompt_tokens=2100, cached_prompt_tokens=500, prefill_seconds=3.0)
    )  # 1000/s now; EWMA with alpha 0.5
    assert meter.prefill_tokens_per_s == 750.0
    meter.update(EngineLoad(prompt_tokens=10))  # counters went back: a restart, skipped
    assert meter.prefill_tokens_per_s == 750.0
    meter.update(EngineLoad(prompt_tokens=20, generation_tokens=50, decode_seconds=0.5))
    assert meter.decode_tokens_per_s == 100.0


def test_cli_flags_env_fallback_and_validation() -> None:
    config, level = config_from_args(
        ["--events", "tcp://127.0.0.1:5557", "--url", "http://127.0.0.1:8000"],
        env={"KVROUTE_REDIS_URL": "redis://r:6379/1", "KVROUTE_BLOCK_SIZE": "32"},
    )
    assert config.events == "tcp://127.0.0.1:5557" and config.url == "http://127.0.0.1:8000"
    assert config.redis_url == "redis://r:6379/1" and config.block_size == 32
    assert config.engine == "vllm" and level == "INFO"
    with pytest.raises(ValueError, match="--url"):
        config_from_args(["--events", "tcp://h:1"], env={})
    with pytest.raises(ValueError, match="--events"):
        config_from_args(["--events", "h:1", "--url", "http://h"], env={})
    with pytest.raises(ValueError, match="--block-size"):
        config_from_args(
            ["--events", "tcp://h:1", "--url", "http://h", "--block-size", "0"], env={}
        )
    with pytest.raises(ValueError, match="--heartbeat-ttl"):
        config_from_args(
            ["--events", "tcp://h:1", "--url", "http://h", "--heartbeat-ttl", "0.5"], env={}
        )
