"""``bench_engine --against vllm``: kvroute's engine and vLLM's, side by side over HTTP.

Both engines serve the same model folder, dtype and block size (32, vLLM's
CPU minimum) with prefix caching on, as real servers: kvroute's worker
(``kvroute worker``, its OpenAI HTTP front, a private Redis for its
publisher) and vLLM's ``vllm.entrypoints.openai.api_server`` from
``.venv-vllm`` (``.ci/vllm-venv.sh`` builds it). Both get the same KV space
(``--kv-space-gib``), the same step budget (``--max-batch-tokens``) and the
same threads (``--threads``; vLLM pinned with ``VLLM_CPU_OMP_THREADS_BIND``).
One client measures both the same way: token-id prompts on streaming
``/v1/completions``, TTFT = time to the first streamed text (or to the end of
a one-token response).

Each round runs, on one engine and then the other (the order alternates
between rounds, so neither always runs on the warmer machine; the engine not
being measured is SIGSTOPped meanwhile, so its idle polling takes nothing
from the one that is):

1. TTFT cold: a fresh ``--prompt-tokens`` prompt, one token out;
2. TTFT hit: a sibling sharing its first ``--shared-tokens`` tokens, then the
   prompt itself (the figure is the second request);
3. throughput: ``--concurrency`` prompts at once, ``--new-tokens`` greedy
   tokens each with ``ignore_eos``.

Every round uses new prompts (seeded, identical for both engines). Figures
are medians over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.vllm_fleet import vllm_cpu_env

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
# Longer than any pause of the kvroute worker while vLLM is measured (see start_servers).
PAUSE_PROOF_TTL_S = 3600


@dataclass(frozen=True)
class AgainstConfig:
    """What both servers run with; set from bench_engine's flags."""

    model: str = "smollm2"
    dtype: str = "float32"
    block_size: int = 32
    prompt_tokens: int = 2048
    shared_tokens: int = 1984
    new_tokens: int = 256
    concurrency: int = 8
    throughput_prompt_tokens: int = 32
    max_batch_tokens: int = 2048
    rounds: int = 3
    threads: int = 2
    kv_space_gib: int = 2
    vllm_eager: bool = False
    startup_timeout: float = 600.0
    seed: int = 0
    log_dir: str = ""


def _free_port() -> int:
    from loadtest.fleet import free_port

    return free_port()


class Server:
    """One child server process (own process group), its log file and base URL."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.port, self.log_path = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("wb")
        logger.info("starting %s: %s", name, " ".join(cmd))
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_healthy(self, session: Any, timeout: float) -> float:
        """Seconds until ``GET /health`` answers 200; raises with the log tail otherwise."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; its log ends:\n{self.tail()}")
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                async with session.get(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            await asyncio.sleep(1.0)
        raise TimeoutError(f"{self.name} not healthy in {timeout:.0f}s:\n{self.tail()}")

    def pause(self) -> None:
        """SIGSTOP the server's process group: an idle vLLM still polls (~13 % of a core
        here), which on two cores would be taken from whichever engine is measured."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()  # a stopped process would not act on SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children that outlived the parent
        self._log.close()


def kv_blocks(cfg: AgainstConfig, model_dir: Path) -> int:
    """kvroute blocks that hold what ``--kv-space-gib`` of vLLM KV space holds."""
    from worker.model.llama import read_model_spec

    spec = read_model_spec(model_dir)
    elem = {"float32": 4}.get(cfg.dtype, 2)
    block = 2 * spec.num_layers * cfg.block_size * spec.num_kv_heads * spec.head_dim * elem
    return int(cfg.kv_space_gib * (1 << 30) // block)


def vllm_server(
    model_dir: Path,
    dtype: str,
    block_size: int,
    port: int,
    kv_space_gib: int,
    threads: int,
    *extra: str,
) -> tuple[list[str], dict[str, str]]:
    """The command and env of a benchmark's vLLM CPU server (model served as "bench"),
    its KV space and its OpenMP threads pinned to the first ``threads`` CPUs."""
    cmd = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "bench", "--dtype", dtype,
        "--block-size", str(block_size), "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip
    return cmd, vllm_cpu_env(kv_space_gib, f"0-{max(threads, 1) - 1}")


def start_servers(cfg: AgainstConfig, model_dir: Path, logs: Path) -> tuple[dict, list]:
    """Starts Redis, the kvroute worker and vLLM; returns {name: Server} and extra processes."""
    threads = str(cfg.threads)
    redis_port, grpc_port = _free_port(), _free_port()
    redis = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(logs)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=threads, KVROUTE_LOG_LEVEL="WARNING")
    kv_port = _free_port()
    kvroute = Server(
        "kvroute",
        [sys.executable, "-m", "kvroute_cli", "worker", "--model", str(model_dir),
         "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--host", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--http-port", str(kv_port),
         "--block-size", str(cfg.block_size), "--dtype", cfg.dtype,
         "--num-blocks", str(kv_blocks(cfg, model_dir)),
         "--max-batch-tokens", str(cfg.max_batch_tokens),
         # Frozen while vLLM runs, the worker's registry key would lapse (TTL 3 s) and
         # every thaw re-send its whole block set to Redis, in the middle of the next
         # measured request (+20 ms on a 0.18 s hit). A running worker never does that.
         "--heartbeat-ttl", str(PAUSE_PROOF_TTL_S)],
        env, kv_port, logs / "kvroute.log",
    )  # fmt: skip
    vllm_port = _free_port()
    vllm_cmd, vllm_env = vllm_server(
        model_dir, cfg.dtype, cfg.block_size, vllm_port, cfg.kv_space_gib, cfg.threads,
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", str(cfg.prompt_tokens + 64),
        "--max-num-batched-tokens", str(max(cfg.max_batch_tokens, cfg.prompt_tokens + 64)),
    )  # fmt: skip
    if cfg.vllm_eager:
        vllm_cmd.append("--enforce-eager")
    vllm = Server("vllm", vllm_cmd, vllm_env, vllm_port, logs / "vllm.log")
    return {"kvroute": kvroute, "vllm": vllm}, [redis]


async def complete(
    session: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed greedy completion: TTFT (first text), text, usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    parts.append(choice["text"])
            usage = event.get("usage") or usage
    elapsed = time.perf_counter() - started
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else elapsed,
        "text": "".join(parts),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


def round_prompts(cfg: AgainstConfig, vocab: int, r: int) -> dict[str, Any]:
    from loadtest.bench_engine import random_prompt

    base = cfg.seed + 1000 * (r + 1)
    hit = random_prompt(vocab, cfg.prompt_tokens, base + 2)
    tail = random_prompt(vocab, cfg.prompt_tokens - cfg.shared_tokens, base + 3)
    return {
        "cold": random_prompt(vocab, cfg.prompt_tokens, base + 1),
        "hit": hit,
        "sibling": hit[: cfg.shared_tokens] + tail,
        "tput": [
            random_prompt(vocab, cfg.throughput_prompt_tokens, base + 100 + i)
            for i in range(cfg.concurrency)
        ],
    }


async def one_round(session: Any, url: str, model: str, p: dict, cfg: AgainstConfig) -> dict:
    cold = await complete(session, url, model, p["cold"], 1)
    await complete(session, url, model, p["sibling"], 1)
    hit = await complete(session, url, model, p["hit"], 1)
    started = time.perf_counter()
    outs = await asyncio.gather(
        *(complete(session, url, model, q, cfg.new_tokens) for q in p["tput"])
    )
    elapsed = time.perf_counter() - started
    return {
        "ttft_cold_s": cold["ttft_s"],
        "ttft_hit_s": hit["ttft_s"],
        "hit_cached_tokens": hit["cached_tokens"],
        "tokens_per_s": sum(o["completion_tokens"] for o in outs) / elapsed,
        "texts": [o["text"] for o in outs],
        "first_texts": [cold["text"], hit["text"]],
    }


async def _model_name(session: Any, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        return str((await resp.json())["data"][0]["id"])


async def measure(cfg: AgainstConfig, model_dir: Path, vocab: int, logs: Path) -> dict:
    import aiohttp

    servers, extra = start_servers(cfg, model_dir, logs)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ready = {}
            for name, server in servers.items():
                ready[name] = await server.wait_healthy(session, cfg.startup_timeout)
            models = {name: await _model_name(session, s.url) for name, s in servers.items()}
            for name, server in servers.items():  # warm-up, not measured
                warm = list(range(1000, 1064))
                await complete(session, server.url, models[name], warm, 4)
                await asyncio.gather(
                    *(complete(session, server.url, models[name], warm[i:], 8) for i in range(8))
                )
            results: dict[str, list[dict]] = {name: [] for name in servers}
            load = [os.getloadavg()[0]]
            for r in range(cfg.rounds):
                prompts = round_prompts(cfg, vocab, r)
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    # Only the measured engine runs; the other is frozen (see Server.pause).
                    for other, server in servers.items():
                        if other == name:
                            server.resume()
                        else:
                            server.pause()
                    await asyncio.sleep(1.0)  # let the frozen one's last work drain off the cores
                    out = await one_round(session, servers[name].url, models[name], prompts, cfg)
                    results[name].append(out)
                    logger.warning(
                        "round %d %s: cold %.3fs hit %.3fs %.1f tok/s (load %.1f)",
                        r, name, out["ttft_cold_s"], out["ttft_hit_s"], out["tokens_per_s"],
                        os.getloadavg()[0],
                    )  # fmt: skip
                load.append(os.getloadavg()[0])
    finally:
        for server in servers.values():
            server.stop()
        for proc in extra:
            proc.terminate()
            proc.wait(timeout=10)
    return {"results": results, "ready_s": ready, "load": load}


def summarize(cfg: AgainstConfig, measured: dict) -> dict[str, Any]:
    """Medians per engine and the kvroute / vLLM ratios."""
    res = measured["results"]

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in res[name])

    kv_tps, vl_tps = med("kvroute", "tokens_per_s"), med("vllm", "tokens_per_s")
    kv_cold, vl_cold = med("kvroute", "ttft_cold_s"), med("vllm", "ttft_cold_s")
    kv_hit, vl_hit = med("kvroute", "ttft_hit_s"), med("vllm", "ttft_hit_s")
    same = [
        a == b
        for kr, vr in zip(res["kvroute"], res["vllm"], strict=True)
        for a, b in zip(kr["texts"], vr["texts"], strict=True)
    ]
    return {
        "measured_over": "http: both engines as OpenAI servers, one streaming client",
        "ttft_cold_s": round(kv_cold, 4),
        "ttft_hit_s": round(kv_hit, 4),
        "ttft_ratio": round(kv_cold / kv_hit, 2),
        "hit_cached_tokens": res["kvroute"][-1]["hit_cached_tokens"],
        "engine_tokens_per_s": round(kv_tps, 2),
        "vllm_ttft_cold_s": round(vl_cold, 4),
        "vllm_ttft_hit_s": round(vl_hit, 4),
        "vllm_hit_cached_tokens": res["vllm"][-1]["hit_cached_tokens"],
        "vllm_tokens_per_s": round(vl_tps, 2),
        "throughput_vs_vllm": round(kv_tps / vl_tps, 3),
        "ttft_cold_vs_vllm": round(kv_cold / vl_cold, 3),
        "ttft_hit_vs_vllm": round(kv_hit / vl_hit, 3),
        "rounds": cfg.rounds,
        "per_round": {
            name: [{k: round(v, 4) for k, v in r.items() if isinstance(v, float)} for r in rounds]
            for name, rounds in res.items()
        },
        "outputs_match_vllm": round(sum(same) / len(same), 3),
        "load_average": [round(x, 2) for x in measured["load"]],
        "server_ready_s": {k: round(v, 1) for k, v in measured["ready_s"].items()},
    }


def run_against_vllm(cfg: AgainstConfig, hf_check: Any) -> dict[str, Any]:
    """Runs the side-by-side benchmark; ``hf_check(prompts, texts)`` adds the HF comparison."""
    from worker.model.llama import read_model_spec
    from worker.model.store import resolve_model

    if not (VLLM_VENV / "bin" / "python").exists():
        raise RuntimeError(f"--against vllm needs {VLLM_VENV}: run .ci/vllm-venv.sh first")
    model_dir = resolve_model(cfg.model)
    vocab = read_model_spec(model_dir).vocab_size
    logs = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="bench-engine-"))
    logs.mkdir(parents=True, exist_ok=True)
    measured = asyncio.run(measure(cfg, model_dir, vocab, logs))
    out = summarize(cfg, measured)
    first = measured["results"]["kvroute"][0]
    out.update(hf_check(round_prompts(cfg, vocab, 0), first["texts"], first["first_texts"]))
    out["logs"] = str(logs)
    return out


def target_met(out: dict[str, Any]) -> bool:
    """The issue's bar: at least vLLM's throughput and at most its cold TTFT."""
    return out["throughput_vs_vllm"] >= 1.0 and out["ttft_cold_vs_vllm"] <= 1.0


def texts_of(tokenizer: Any, outputs: Sequence[list[int]]) -> list[str]:
    return [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
