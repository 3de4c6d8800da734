"""NVIDIA aiperf as a third-party load client: its own venv, an offline tokenizer, trace replay.

aiperf (PyPI ``aiperf``) lives in ``.venv-aiperf`` (created on first use with
``pip install aiperf``), never in the project's venv. Offline, aiperf takes
its ``--tokenizer`` as a hub id, so ``hub_cache`` lays the local model folder
out as a Hugging Face hub cache (``models--kvroute--NAME/refs/main`` and a
snapshot of symlinks) and aiperf runs with ``HF_HUB_CACHE`` pointing there and
``HF_HUB_OFFLINE=1``.

``rescale_trace`` turns a Mooncake trace (512-token blocks) into one whose
blocks are ``block_tokens`` long, lengths scaled alike, timestamps stretched
by ``time_scale`` (the emulated engine's slow-down) and compressed by
``speedup``; aiperf replays it with ``--fixed-schedule`` and rebuilds each
prompt from its ``hash_ids`` (``--isl-block-size``), so requests sharing hash
ids share token prefixes. ``run_aiperf`` returns TTFT p50/p95/p99 (seconds,
divided back by ``time_scale``) and output tokens/s from aiperf's JSON export.
``synthetic_command`` is the short closed-loop run of ``loadtest.clients_smoke``
(synthetic prompts behind one shared system prompt, fixed concurrency).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.mooncake_trace import spread_times

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
AIPERF_VERSION = "0.13.0"
MOONCAKE_BLOCK = 512
HUB_ORG = "kvroute"


def ensure_aiperf(venv: str = ".venv-aiperf") -> Path:
    """The ``aiperf`` executable in its own venv, installed from PyPI on first use."""
    path = Path(venv) if Path(venv).is_absolute() else ROOT / venv
    binary = path / "bin" / "aiperf"
    if binary.exists():
        return binary
    if not (path / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, f"aiperf=={AIPERF_VERSION}"], check=True, timeout=1200)
    return binary


def hub_cache(model_dir: str, cache_root: Path) -> str:
    """Lays ``model_dir``'s tokenizer files out as a hub cache; returns the hub id to pass."""
    src = Path(model_dir)
    repo = cache_root / f"models--{HUB_ORG}--{src.name}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    for f in src.iterdir():
        link = snapshot / f.name
        if f.suffix in (".safetensors", ".bin", ".gguf") or link.exists():
            continue  # aiperf needs the tokenizer only
        link.symlink_to(f.resolve())
    return f"{HUB_ORG}/{src.name}"


def rescale_trace(
    src: Path,
    dst: Path,
    *,
    block_tokens: int,
    limit: int,
    time_scale: float = 1.0,
    speedup: float = 1.0,
    spread: bool = False,
) -> dict[str, Any]:
    """Writes the first ``limit`` records of ``src`` with ``block_tokens``-token blocks;
    ``spread``: the requests that share a timestamp spread over the gap to the next
    (``loadtest.mooncake_trace.spread_times``)."""
    factor = block_tokens / MOONCAKE_BLOCK
    rows = []
    with open(src, encoding="utf-8") as fh:
        for line in fh:
            if len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    t0 = rows[0]["timestamp"] if rows else 0
    times = [float(r["timestamp"]) for r in rows]
    times = spread_times(times) if spread else times
    with open(dst, "w", encoding="utf-8") as out:
        for r, t in zip(rows, times, strict=True):
            n_blocks = len(r["hash_ids"])
            length = max(1, math.ceil(r["input_length"] * factor))
            # Keep the last block partial, as in the trace: length within the hash ids' blocks.
            length = min(max(length, (n_blocks - 1) * block_tokens + 1), n_blocks * block_tokens)
            rec = {
                "timestamp": int((t - t0) * time_scale / speedup),
                "input_length": length,
                "output_length": max(1, math.ceil(r["output_length"] * factor)),
                "hash_ids": r["hash_ids"],
            }
            out.write(json.dumps(rec) + "\n")
    span_ms = (rows[-1]["timestamp"] - t0) / speedup if rows else 0
    return {"requests": len(rows), "span_s": span_ms / 1000, "block_tokens": block_tokens}


def aiperf_command(
    binary: Path,
    *,
    model: str,
    tokenizer: str,
    urls: Sequence[str],
    trace: Path,
    block_tokens: int,
    artifact_dir: Path,
) -> list[str]:
    """The aiperf command line replaying ``trace`` against ``urls`` (round robin across them)."""
    cmd = [str(binary), "profile", "--model", model, "--tokenizer", tokenizer]
    for url in urls:
        cmd += ["--url", url]
    if len(urls) > 1:
        cmd += ["--url-strategy", "round_robin"]
    cmd += [
        "--endpoint-type",
        "completions",
        "--streaming",
        "--input-file",
        str(trace),
        "--custom-dataset-type",
        "mooncake_trace",
        "--isl-block-size",
        str(block_tokens),
        "--fixed-schedule",
        "--extra-inputs",
        "ignore_eos:true",
        "--random-seed",
        "0",
        "--output-artifact-dir",
        str(artifact_dir),
        "--ui-type",
        "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
    ]
    return cmd


def synthetic_command(
    binary: Path,
    *,
    model: str,
    tokenizer: str,
    url: str,
    requests: int,
    concurrency: int,
    prompt_tokens: int,
    prefix_tokens: int,
    output_tokens: int,
    artifact_dir: Path,
) -> list[str]:
    """aiperf's own CLI: ``requests`` streamed chat requests at ``concurrency``, shared prefix."""
    cmd = [str(binary), "profile", "--model", model, "--tokenizer", tokenizer, "--url", url]
    cmd += ["--endpoint-type", "chat", "--streaming", "--request-count", str(requests)]
    cmd += ["--concurrency", str(concurrency), "--synthetic-input-tokens-mean", str(prompt_tokens)]
    cmd += ["--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(output_tokens)]
    if prefix_tokens:
        cmd += ["--shared-system-prompt-length", str(prefix_tokens)]
    cmd += ["--extra-inputs", "ignore_eos:true", "--random-seed", "0"]
    cmd += ["--output-artifact-dir", str(artifact_dir), "--ui-type", "none"]
    return [*cmd, "--no-gpu-telemetry", "--no-server-metrics"]


def aiperf_counts(data: dict[str, Any]) -> tuple[int, int]:
    """(successful, errored) requests of aiperf's ``profile_export_aiperf.json``."""
    count = (data.get("request_count") or {}).get("avg", 0)
    summary = data.get("error_summary") or []
    errors = sum(int(e.get("count", 0)) for e in summary if isinstance(e, dict))
    return int(count), errors


def run_aiperf(
    cmd: list[str], cache_root: Path, artifact_dir: Path, *, time_scale: float, timeout_s: float
) -> dict[str, Any]:
    """Runs ``cmd`` offline; TTFT percentiles (s) and throughput, in unscaled units."""
    env = {**os.environ, "HF_HUB_CACHE": str(cache_root), "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    log = artifact_dir / "aiperf-stdout.log"
    artifact_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    export = artifact_dir / "profile_export_aiperf.json"
    if proc.returncode != 0 or not export.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        raise RuntimeError(f"aiperf exited with {proc.returncode}: {' | '.join(tail)}")
    data = json.loads(export.read_text())
    ttft = data["time_to_first_token"]
    count, errors = aiperf_counts(data)
    return {
        "ttft_p50_s": ttft["p50"] / 1000 / time_scale,
        "ttft_p95_s": ttft["p95"] / 1000 / time_scale,
        "ttft_p99_s": ttft["p99"] / 1000 / time_scale,
        "ttft_mean_s": ttft["avg"] / 1000 / time_scale,
        "tokens_per_s": data["output_token_throughput"]["avg"] * time_scale,
        "requests": count,
        "errors": errors,
        "client": "aiperf " + str(data.get("aiperf_version", AIPERF_VERSION)),
    }
