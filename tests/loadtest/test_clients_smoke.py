"""The clients smoke's arithmetic: gateway counters, each client's report, the printed object."""

from __future__ import annotations

from pathlib import Path

from loadtest.aiperf_client import aiperf_counts, synthetic_command
from loadtest.check_guidellm import guidellm_command, guidellm_counts
from loadtest.client_runs import SmokeConfig, Target, client_entry, inference_perf_config
from loadtest.clients_smoke import assemble, hit_rate, token_counters
from loadtest.inference_perf_client import inference_perf_counts

METRICS = """\
# HELP kvroute_gateway_prompt_tokens_total Prompt tokens routed
# TYPE kvroute_gateway_prompt_tokens_total counter
kvroute_gateway_prompt_tokens_total{worker_id="worker-0"} 672.0
kvroute_gateway_prompt_tokens_total{worker_id="worker-1"} 2184.0
kvroute_gateway_prompt_tokens_created{worker_id="worker-0"} 1.7961324779761562e+09
kvroute_gateway_cached_tokens_total{worker_id="worker-0"} 480.0
kvroute_gateway_cached_tokens_total{worker_id="worker-1"} 1120.0
kvroute_gateway_predicted_cached_tokens_total{worker_id="worker-1"} 9999.0
"""


def test_token_counters_sum_workers_and_skip_other_series() -> None:
    assert token_counters(METRICS) == (2856.0, 1600.0)
    assert token_counters("") == (0.0, 0.0)


def test_hit_rate_is_the_delta_between_scrapes() -> None:
    assert hit_rate((1344.0, 960.0), (2856.0, 1600.0)) == round(640 / 1512, 4)
    assert hit_rate((10.0, 5.0), (10.0, 5.0)) is None


def test_report_counts() -> None:
    aiperf = {"request_count": {"unit": "requests", "avg": 22.0}, "error_summary": [{"count": 2}]}
    assert aiperf_counts(aiperf) == (22, 2)
    assert aiperf_counts({"error_summary": []}) == (0, 0)
    totals = {"successful": 11, "errored": 1, "incomplete": 1, "total": 13}
    assert guidellm_counts({"benchmarks": [{"metrics": {"request_totals": totals}}]}) == (11, 2)
    old = {"benchmarks": [{"requests": {"successful": [{}, {}], "errored": [{}]}}]}
    assert guidellm_counts(old) == (2, 1)
    summary = {"successes": {"count": 24}, "failures": {"count": 0, "by_label": {}}}
    assert inference_perf_counts(summary) == (24, 0)


def test_client_entry_ran_only_with_exit_zero_and_a_report(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("first\nTraceback\nboom\n")
    ok = client_entry("x", {"rc": 0, "counts": (24, 0), "version": "1"}, 0.5, 3.04, log)
    assert ok == {
        "ran": True,
        "requests": 24,
        "errors": 0,
        "hit_rate": 0.5,
        "version": "1",
        "seconds": 3.0,
    }
    no_report = client_entry("x", {"rc": 0}, None, 1.0, log)
    assert no_report["ran"] is False and no_report["error"].startswith("no report file")
    failed = client_entry("x", {"rc": 2, "counts": (3, 1)}, None, 1.0, log)
    assert (failed["ran"], failed["requests"], failed["errors"]) == (False, 4, 1)
    assert "x exited with 2" in failed["error"] and "boom" in failed["error"]
    raised = client_entry("x", {"error": "CalledProcessError: pip"}, None, 1.0, tmp_path / "none")
    assert raised["error"] == "CalledProcessError: pip"


def test_target_met_needs_every_client_ran_with_no_errors() -> None:
    good = {"ran": True, "requests": 24, "errors": 0, "hit_rate": 0.4}
    clients = {name: dict(good) for name in ("aiperf", "inference-perf", "guidellm")}
    assert assemble(clients, "cmd") == {"clients": clients, "command": "cmd", "target_met": True}
    clients["guidellm"]["errors"] = 1
    assert assemble(clients, "cmd")["target_met"] is False
    clients["guidellm"] = {"ran": False, "requests": 0, "errors": 0, "hit_rate": None}
    assert assemble(clients, "cmd")["target_met"] is False
    assert assemble({"aiperf": dict(good)}, "cmd")["target_met"] is False


def test_client_commands_carry_the_workload(tmp_path: Path) -> None:
    cfg = SmokeConfig(requests=12, concurrency=3, prefix_tokens=64, prompt_tokens=48)
    target = Target("http://127.0.0.1:9", "SmolLM2-135M-Instruct", "/models/smol")
    ip = inference_perf_config(cfg, target, tmp_path)
    assert ip["load"]["stages"] == [{"num_requests": 12, "concurrency_level": 3}]
    assert ip["data"]["shared_prefix"]["system_prompt_len"] == 64
    assert ip["server"]["base_url"] == target.url
    gl = guidellm_command(
        Path("gl"),
        target=target.url,
        model=target.model,
        tokenizer=target.tokenizer,
        out=tmp_path / "b.json",
        requests=12,
        prompt_tokens=48,
        output_tokens=8,
        concurrency=3,
        prefix_tokens=64,
    )
    assert "--profile=kind=concurrent,streams=3" in gl
    assert not any("validate_backend" in arg for arg in gl)  # guidellm's default: validation on
    ap = synthetic_command(
        Path("aiperf"),
        model=target.model,
        tokenizer="kvroute/smol",
        url=target.url,
        requests=12,
        concurrency=3,
        prompt_tokens=48,
        prefix_tokens=64,
        output_tokens=8,
        artifact_dir=tmp_path,
    )
    assert ap[ap.index("--concurrency") + 1] == "3"
    assert ap[ap.index("--shared-system-prompt-length") + 1] == "64"
