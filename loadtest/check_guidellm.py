"""``python -m loadtest.check_guidellm``: a real guidellm, in its own venv, against the gateway.

guidellm (vLLM's load generator) probes ``GET /health`` and then sends OpenAI chat
requests; this starts a local fleet (``loadtest.fleet.Fleet``), runs guidellm's
synchronous profile for ``--requests`` requests of synthetic text and prints one JSON
object: the guidellm version, requests that succeeded and failed, and ``target_met``
(every request succeeded). ``.venv-guidellm`` is created on first use
(``pip install guidellm``); nothing leaves 127.0.0.1.
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

from loadtest.fleet import Fleet, FleetConfig

ROOT = Path(__file__).resolve().parents[1]


def ensure_venv(venv: Path) -> Path:
    """The guidellm executable, installing it into ``venv`` first when missing."""
    exe = venv / "bin" / "guidellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "guidellm"], check=True)
    return exe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="model folder or smollm2")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--venv", default=str(ROOT / ".venv-guidellm"))
    args = p.parse_args(argv)
    exe = ensure_venv(Path(args.venv))
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
    with Fleet(FleetConfig(model=args.model, workers=1, num_blocks=512)) as fleet:
        with urllib.request.urlopen(fleet.gateway_url + "/v1/models", timeout=10) as resp:
            served = json.loads(resp.read())["data"][0]["id"]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            cmd = [
                str(exe),
                "run",
                f"--backend=kind=openai_http,target={fleet.gateway_url},model={served}",
                "--profile=kind=synchronous",
                f"--constraint=kind=max_requests,count={args.requests}",
                f"--data=kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                f"output_tokens={args.output_tokens}",
                f"--tokenizer=kind=hf_auto,model={fleet.model_dir}",
                f"--output=kind=json,path={out}",
                "--disable-progress",
            ]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
            )
            requests = {}
            if out.exists():
                requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    ok, errored = (len(requests.get(k) or []) for k in ("successful", "errored"))
    print(
        json.dumps(
            {
                "guidellm_version": version.strip().split()[-1] if version else "",
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
