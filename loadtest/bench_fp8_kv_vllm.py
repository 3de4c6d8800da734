"""``bench_fp8_kv --against vllm``: what vLLM's own fp8 KV cache gives on the same prompts.

Starts a vLLM CPU server from ``.venv-vllm`` twice on the same model and
dtype, once with ``--kv-cache-dtype auto`` and once with ``fp8`` (e4m3 with
vLLM's default scale of 1.0: no calibration data is given), sends every
prompt as token ids to ``/v1/completions`` at once (greedy, ``ignore_eos``)
and reads the output token ids back (``return_token_ids``). The caller
compares them exactly as it compares kvroute's two caches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from loadtest.bench_engine_vllm import VLLM_VENV, Server, _free_port, vllm_server

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32  # vLLM's CPU minimum
STARTUP_TIMEOUT_S = 600.0


async def _greedy(session: Any, url: str, prompt: list[int], new_tokens: int) -> list[int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        choice = (await resp.json())["choices"][0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise RuntimeError(f"{url}: no token_ids in the response (vLLM too old?)")
    return [int(t) for t in ids]


async def vllm_outputs(
    model_dir: Path, dtype: str, kv_cache_dtype: str, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Greedy outputs of every prompt from a fresh vLLM server with ``kv_cache_dtype``."""
    import aiohttp

    if not (VLLM_VENV / "bin" / "python").exists():
        raise RuntimeError(f"{VLLM_VENV} is missing: run `bash .ci/vllm-venv.sh` first")
    port = _free_port()
    longest = max(map(len, prompts)) + new_tokens
    cmd, env = vllm_server(
        model_dir, dtype, BLOCK_SIZE, port, 1, os.cpu_count() or 1,
        "--kv-cache-dtype", kv_cache_dtype,
        "--max-model-len", str(longest + BLOCK_SIZE), "--max-num-seqs", str(len(prompts)),
    )  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="fp8-vllm-")) / f"vllm-{kv_cache_dtype}.log"
    server = Server(f"vllm-{kv_cache_dtype}", cmd, env, port, log)
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=STARTUP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ready = await server.wait_healthy(session, STARTUP_TIMEOUT_S)
            logger.warning("vLLM (kv %s) ready in %.0fs; log %s", kv_cache_dtype, ready, log)
            return list(
                await asyncio.gather(
                    *(_greedy(session, server.url, p, new_tokens) for p in prompts)
                )
            )
    finally:
        server.stop()
