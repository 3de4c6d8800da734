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
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.child_logs import ChildLog
from loadtest.client_runs import CLIENTS, ROOT, RUNNERS, SmokeConfig, Target, client_entry
from loadtest.fleet import free_port, sigterm_as_ctrl_c

PROMPT_COUNTER = "kvroute_gateway_prompt_tokens_total"
CACHED_COUNTER = "kvroute_gateway_cached_tokens_total"


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


def assemble(clients: dict[str, dict[str, Any]], command: str) -> dict[str, Any]:
    """The printed object; ``target_met`` from the clients' own figures."""
    met = all(
        c["ran"] and c["errors"] == 0 and c["requests"] > 0 for c in clients.values()
    ) and set(clients) == set(CLIENTS)
    return {"clients": clients, "command": command, "target_met": met}


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
    with sigterm_as_ctrl_c():  # the smoke starts a fleet and each client's process
        results = smoke(cfg, clients)
    print(json.dumps(assemble(results, command)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
