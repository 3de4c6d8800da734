"""``python -m loadtest.clients_smoke``: aiperf, inference-perf and guidellm, unchanged, against ``kvroute up``.

Starts ``kvroute up`` (private Redis, ``--workers`` SmolLM2 workers, the gateway)
as a child process, then runs each third-party load client from its own venv
(``.venv-aiperf``, ``.venv-inference-perf``, ``.venv-guidellm``; installed from
PyPI on first use) through its own CLI: ``--requests`` streamed chat requests at
``--concurrency``, each prompt a shared prefix plus a unique part, short outputs.
guidellm keeps its default backend validation (``GET /health``).

Each client's ``requests`` and ``errors`` come from the client's own report file;
``hit_rate`` is cached / prompt tokens from the gateway's ``/metrics``, scraped
before and after that client. Prints one JSON object; ``target_met`` is every
client ran (exit 0 and a report) with 0 errors. A client that cannot run says
``ran: false`` and why in ``error``. Reports and logs stay in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import aiperf_client, check_guidellm
from loadtest.child_logs import ChildLog
from loadtest.fleet import free_port

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ("aiperf", "inference-perf", "guidellm")
INFERENCE_PERF_VERSION = "0.7.0"
PROMPT_COUNTER = "kvroute_gateway_prompt_tokens_total"
CACHED_COUNTER = "kvroute_gateway_cached_tokens_total"


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


# --- what the gateway and the clients report -------------------------------------------------


def token_counters(metrics_text: str) -> tuple[float, float]:
    """(prompt, cached) tokens the gateway has routed, summed over workers."""
    sums = {PROMPT_COUNTER: 0.0, CACHED_COUNTER: 0.0}
    for line in metrics_text.splitlines():
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums[PROMPT_COUNTER], sums[CACHED_COUNTER]


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Cached / prompt tokens between two scrapes; None when no prompt token was routed."""
    prompt, cached = after[0] - before[0], after[1] - before[1]
    return round(cached / prompt, 4) if prompt > 0 else None


def inference_perf_counts(summary: dict[str, Any]) -> tuple[int, int]:
    """(successful, failed) requests of inference-perf's ``summary_lifecycle_metrics.json``."""
    return int(summary["successes"]["count"]), int(summary["failures"]["count"])


def assemble(clients: dict[str, dict[str, Any]], command: str) -> dict[str, Any]:
    """The printed object; ``target_met`` from the clients' own figures."""
    met = all(
        c["ran"] and c["errors"] == 0 and c["requests"] > 0 for c in clients.values()
    ) and set(clients) == set(CLIENTS)
    return {"clients": clients, "command": command, "target_met": met}


# --- the clients' venvs ----------------------------------------------------------------------


def python_312() -> str | None:
    """A Python >= 3.12 that runs: python3.13/python3.12 on PATH, or one pyenv installed."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [shutil.which(name) for name in ("python3.12", "python3.13")]
    found += [str(p) for p in sorted(pyenv.glob("3.1[2-9]*/bin/python3"))]
    check = "import sys; sys.exit(sys.version_info < (3, 12))"
    for python in filter(None, found):
        # pyenv puts shims on PATH for versions it has but has not selected: they fail.
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if (
                subprocess.run([python, "-c", check], capture_output=True, timeout=30).returncode
                == 0
            ):
                return python
    return None


def ensure_inference_perf(venv: Path) -> tuple[Path, str]:
    """inference-perf's executable in ``venv``, installed on first use; and its interpreter.

    inference-perf declares Python >= 3.12, so the venv is made with ``python_312()``.
    Where there is none, the unchanged wheel goes into a 3.11 venv with
    ``--no-deps --ignore-requires-python`` and its declared dependencies are installed
    normally (each still meets its own Python floor); the note says so.
    """
    exe, done = venv / "bin" / "inference-perf", venv / ".kvroute-installed"
    if exe.exists() and done.exists():
        return exe, done.read_text().strip()
    python = python_312()
    note = "" if python else "Python 3.11 with --ignore-requires-python (declares >= 3.12)"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python or sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    spec = f"inference-perf=={INFERENCE_PERF_VERSION}"
    if python:
        subprocess.run([*pip, spec], check=True, timeout=1800)
    else:
        subprocess.run(
            [*pip, "--no-deps", "--ignore-requires-python", spec], check=True, timeout=600
        )
        list_deps = (
            "import importlib.metadata as m; "
            "print('\\n'.join(r for r in m.requires('inference-perf') or [] if 'extra ==' not in r))"
        )
        deps = subprocess.run(
            [str(venv / "bin" / "python"), "-c", list_deps],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split("\n")
        subprocess.run([*pip, *[d for d in deps if d.strip()]], check=True, timeout=1800)
    done.write_text(note + "\n")  # only now: a half-installed venv is installed again
    return exe, note


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


# --- one client, one run ---------------------------------------------------------------------


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


# --- the fleet -------------------------------------------------------------------------------


def scrape(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return token_counters(resp.read().decode())


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def start_up(cfg: SmokeConfig) -> tuple[subprocess.Popen[bytes], ChildLog, str]:
    """``kvroute up`` as a child; returns once the gateway sees every worker."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvroute_cli", "up", "--model", cfg.model]
    cmd += ["--workers", str(cfg.workers), "--port", str(port), "--quiet"]
    cmd += ["--log-dir", str(cfg.out_dir / "fleet-logs")]
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    log = ChildLog("kvroute-up", proc.stdout, cfg.out_dir / "kvroute-up.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.join()
            raise RuntimeError(f"kvroute up exited with {proc.returncode}:\n{log.tail()}")
        try:
            if _get_json(url + "/readyz").get("healthy_workers", 0) >= cfg.workers:
                return proc, log, url
        except (urllib.error.URLError, OSError, ValueError):
            pass  # not listening yet
        time.sleep(1.0)
    stop_up(proc, log)
    raise TimeoutError(f"kvroute up: {cfg.workers} workers not healthy within 600s:\n{log.tail()}")


def stop_up(proc: subprocess.Popen[bytes], log: ChildLog) -> None:
    """SIGTERM, as Ctrl-C would: ``kvroute up`` stops its children and exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    log.join()


def smoke(cfg: SmokeConfig, clients: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Runs every client in turn against one fleet; their JSON entries by name."""
    from worker.model.store import resolve_model

    tokenizer = str(resolve_model(cfg.model))
    proc, up_log, url = start_up(cfg)
    try:
        target = Target(url, _get_json(url + "/v1/models")["data"][0]["id"], tokenizer)
        out: dict[str, dict[str, Any]] = {}
        for name in clients:
            work = cfg.out_dir / name
            shutil.rmtree(work, ignore_errors=True)
            before, t0 = scrape(url), time.monotonic()
            try:
                raw = RUNNERS[name](cfg, target, work)
            except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
                raw = {"error": f"{type(exc).__name__}: {exc}"}
            rate = hit_rate(before, scrape(url))
            out[name] = client_entry(name, raw, rate, time.monotonic() - t0, work / f"{name}.log")
        return out
    finally:
        stop_up(proc, up_log)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24, help="requests per client (default 24)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (default 2)")
    p.add_argument("--prefix-tokens", type=int, default=64, help="shared prompt prefix")
    p.add_argument("--prompt-tokens", type=int, default=48, help="unique part of each prompt")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="model folder or smollm2")
    p.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset")
    p.add_argument("--out-dir", default=str(SmokeConfig.out_dir), help="reports and logs")
    args = p.parse_args(argv)
    clients = tuple(c for c in args.clients.split(",") if c)
    unknown = [c for c in clients if c not in RUNNERS]
    if unknown:
        p.error(f"--clients: unknown {', '.join(unknown)} (choose from {', '.join(CLIENTS)})")
    cfg = SmokeConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        prefix_tokens=args.prefix_tokens,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        workers=args.workers,
        model=args.model,
        out_dir=Path(args.out_dir).resolve(),
    )
    command = shlex.join([".venv/bin/python", "-m", "loadtest.clients_smoke", *argv])
    print(json.dumps(assemble(smoke(cfg, clients), command)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
