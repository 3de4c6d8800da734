"""Each third-party load client of ``loadtest.clients_smoke``, run once through its own CLI.

``SmokeConfig`` is the one workload every client gets (``--requests`` streamed
chat requests at ``--concurrency``, each prompt a shared prefix plus a unique
part, short outputs) and ``Target`` the fleet as a client sees it. A runner
(``RUNNERS``: aiperf, inference-perf, guidellm) installs its client's venv on
first use, runs it and returns its exit status and report counts;
``inference_perf_config`` is that workload as inference-perf's config;
``client_entry`` turns a run into the client's JSON entry.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import aiperf_client, check_guidellm
from loadtest.inference_perf_client import (
    INFERENCE_PERF_VERSION,
    ensure_inference_perf,
    inference_perf_counts,
)

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ("aiperf", "inference-perf", "guidellm")


@dataclass(frozen=True)
class SmokeConfig:
    """One workload for every client, and where things go."""

    requests: int = 24
    concurrency: int = 2
    prefix_tokens: int = 64
    prompt_tokens: int = 48
    output_tokens: int = 8
    workers: int = 2
    model: str = "smollm2"
    out_dir: Path = ROOT / "loadtest" / "results" / "clients_smoke"
    venv_root: Path = ROOT
    client_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for flag, value in (("--requests", self.requests), ("--concurrency", self.concurrency)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True)
class Target:
    """The fleet as a client sees it."""

    url: str
    model: str  # the served name
    tokenizer: str  # the local model folder


def inference_perf_config(cfg: SmokeConfig, target: Target, report_dir: Path) -> dict[str, Any]:
    """inference-perf's YAML config (as a dict): shared-prefix prompts, a concurrent stage."""
    return {
        "api": {"type": "chat", "streaming": True},
        "server": {
            "type": "vllm",
            "model_name": target.model,
            "base_url": target.url,
            "ignore_eos": True,
        },
        "tokenizer": {"pretrained_model_name_or_path": target.tokenizer},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": 1,
                "num_prompts_per_group": cfg.requests,
                "system_prompt_len": cfg.prefix_tokens,
                "question_len": cfg.prompt_tokens,
                "output_len": cfg.output_tokens,
                "seed": 0,
            },
        },
        "load": {
            "type": "concurrent",
            "num_workers": 1,
            "stages": [{"num_requests": cfg.requests, "concurrency_level": cfg.concurrency}],
        },
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


def _run(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        try:
            return subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def _log_tail(log: Path, lines: int = 4) -> str:
    kept = log.read_text(errors="replace").strip().splitlines()[-lines:] if log.exists() else []
    return " | ".join(line.strip() for line in kept)


def run_aiperf(cfg: SmokeConfig, target: Target, out: Path) -> dict[str, Any]:
    binary = aiperf_client.ensure_aiperf(str(cfg.venv_root / ".venv-aiperf"))
    hub = out / "hub"
    hub_id = aiperf_client.hub_cache(target.tokenizer, hub)
    export = out / "artifacts" / "profile_export_aiperf.json"
    cmd = aiperf_client.synthetic_command(
        binary,
        model=target.model,
        tokenizer=hub_id,
        url=target.url,
        requests=cfg.requests,
        concurrency=cfg.concurrency,
        prompt_tokens=cfg.prompt_tokens,
        prefix_tokens=cfg.prefix_tokens,
        output_tokens=cfg.output_tokens,
        artifact_dir=export.parent,
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    rc = _run(cmd, out / "aiperf.log", env, cfg.client_timeout_s)
    result: dict[str, Any] = {"rc": rc, "version": aiperf_client.AIPERF_VERSION}
    if export.exists():
        result["counts"] = aiperf_client.aiperf_counts(json.loads(export.read_text()))
    return result


def run_inference_perf(cfg: SmokeConfig, target: Target, out: Path) -> dict[str, Any]:
    binary, note = ensure_inference_perf(cfg.venv_root / ".venv-inference-perf")
    report_dir = out / "report"
    config = out / "config.yml"
    out.mkdir(parents=True, exist_ok=True)
    # JSON is YAML; inference-perf reads it with yaml.safe_load.
    config.write_text(json.dumps(inference_perf_config(cfg, target, report_dir), indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rc = _run(
        [str(binary), "-c", str(config)], out / "inference-perf.log", env, cfg.client_timeout_s
    )
    result: dict[str, Any] = {"rc": rc, "version": INFERENCE_PERF_VERSION}
    if note:
        result["install"] = note
    summary = report_dir / "summary_lifecycle_metrics.json"
    if summary.exists():
        result["counts"] = inference_perf_counts(json.loads(summary.read_text()))
    return result


def run_guidellm(cfg: SmokeConfig, target: Target, out: Path) -> dict[str, Any]:
    exe = check_guidellm.ensure_venv(cfg.venv_root / ".venv-guidellm")
    report = out / "benchmarks.json"
    cmd = check_guidellm.guidellm_command(
        exe,
        target=target.url,
        model=target.model,
        tokenizer=target.tokenizer,
        out=report,
        requests=cfg.requests,
        prompt_tokens=cfg.prompt_tokens,
        output_tokens=cfg.output_tokens,
        concurrency=cfg.concurrency,
        prefix_tokens=cfg.prefix_tokens,
    )
    rc = _run(
        cmd, out / "guidellm.log", {**os.environ, "HF_HUB_OFFLINE": "1"}, cfg.client_timeout_s
    )
    result: dict[str, Any] = {"rc": rc, "version": check_guidellm.guidellm_version(exe)}
    if report.exists():
        result["counts"] = check_guidellm.guidellm_counts(json.loads(report.read_text()))
    return result


RUNNERS: dict[str, Callable[[SmokeConfig, Target, Path], dict[str, Any]]] = {
    "aiperf": run_aiperf,
    "inference-perf": run_inference_perf,
    "guidellm": run_guidellm,
}


def client_entry(
    name: str, raw: dict[str, Any], rate: float | None, seconds: float, log: Path
) -> dict[str, Any]:
    """One client's JSON entry from what its runner found (exit status, report counts)."""
    counts = raw.get("counts")
    ran = raw.get("rc") == 0 and counts is not None
    ok, errors = counts if counts is not None else (0, 0)
    entry: dict[str, Any] = {
        "ran": ran,
        "requests": ok + errors,
        "errors": errors,
        "hit_rate": rate,
        "version": raw.get("version", ""),
        "seconds": round(seconds, 1),
    }
    if "install" in raw:
        entry["install"] = raw["install"]
    if not ran:
        why = raw.get("error") or (
            f"{name} exited with {raw.get('rc')}" if raw.get("rc") != 0 else "no report file"
        )
        entry["error"] = f"{why}; log {log}: {_log_tail(log)}" if log.exists() else why
    return entry
