"""``python -m loadtest.check_guidellm``: a real guidellm, in its own venv, against the gateway.

guidellm (vLLM's load generator) probes ``GET /health`` (its default backend
validation) and then sends OpenAI chat requests; this starts a local fleet
(``loadtest.fleet.Fleet``), runs guidellm's synchronous profile for ``--requests``
requests of synthetic text and prints one JSON object: the guidellm version,
requests that succeeded and failed, and ``target_met`` (every request succeeded).
``.venv-guidellm`` is created on first use (``pip install guidellm``, pinned);
nothing leaves 127.0.0.1. ``guidellm_command`` and ``guidellm_counts`` are shared
with ``loadtest.clients_smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.fleet import Fleet, FleetConfig

ROOT = Path(__file__).resolve().parents[1]
GUIDELLM_VERSION = "0.8.1"


def ensure_venv(venv: Path) -> Path:
    """The guidellm executable, installing it into ``venv`` first when missing."""
    exe = venv / "bin" / "guidellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"guidellm=={GUIDELLM_VERSION}"],
            check=True,
        )
    return exe


def guidellm_version(exe: Path) -> str:
    """What ``guidellm --version`` says, last word only (``0.8.1``)."""
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
    return out.strip().split()[-1] if out.strip() else ""


def guidellm_command(
    exe: Path,
    *,
    target: str,
    model: str,
    tokenizer: str,
    out: Path,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    concurrency: int = 0,
    prefix_tokens: int = 0,
) -> list[str]:
    """guidellm's own CLI: synchronous (``concurrency`` 0) or concurrent streams, JSON report."""
    profile = f"kind=concurrent,streams={concurrency}" if concurrency else "kind=synchronous"
    data = f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}"
    if prefix_tokens:
        data += f",prefix_tokens={prefix_tokens},prefix_count=1"
    return [
        str(exe),
        "run",
        f"--backend=kind=openai_http,target={target},model={model}",
        f"--profile={profile}",
        f"--constraint=kind=max_requests,count={requests}",
        f"--data={data}",
        f"--tokenizer=kind=hf_auto,model={tokenizer}",
        f"--output=kind=json,path={out}",
        "--disable-progress",
    ]


def guidellm_counts(report: dict[str, Any]) -> tuple[int, int]:
    """(successful, not successful) requests of a guidellm JSON report's first benchmark."""
    bench = report["benchmarks"][0]
    totals = (bench.get("metrics") or {}).get("request_totals")
    if totals:
        return int(totals["successful"]), int(totals["errored"]) + int(totals["incomplete"])
    requests = bench["requests"]  # older reports: the request lists themselves
    ok = len(requests.get("successful") or [])
    return ok, len(requests.get("errored") or []) + len(requests.get("incomplete") or [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="model folder or smollm2")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--venv", default=str(ROOT / ".venv-guidellm"))
    args = p.parse_args(argv)
    exe = ensure_venv(Path(args.venv))
    version = guidellm_version(exe)
    with Fleet(FleetConfig(model=args.model, workers=1, num_blocks=512)) as fleet:
        with urllib.request.urlopen(fleet.gateway_url + "/v1/models", timeout=10) as resp:
            served = json.loads(resp.read())["data"][0]["id"]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            cmd = guidellm_command(
                exe,
                target=fleet.gateway_url,
                model=served,
                tokenizer=fleet.model_dir,
                out=out,
                requests=args.requests,
                prompt_tokens=args.prompt_tokens,
                output_tokens=args.output_tokens,
            )
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
            )
            ok, errored = guidellm_counts(json.loads(out.read_text())) if out.exists() else (0, 0)
    print(
        json.dumps(
            {
                "guidellm_version": version,
                "guidellm_rc": proc.returncode,
                "requests_successful": ok,
                "requests_errored": errored,
                "target_met": proc.returncode == 0 and ok == args.requests and errored == 0,
            }
        )
    )
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
