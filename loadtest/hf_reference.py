"""Hugging Face ``generate`` as ``bench_engine``'s reference: greedy outputs and their time.

``hf_greedy`` never stops early (the engine runs with ``ignore_eos``), so its
tokens can be compared with the engine's token for token; ``run_hf_part``
times the throughput prompts one request at a time and takes the first
greedy token of the TTFT prompts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadtest.bench_engine import BenchConfig


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """HF ``generate`` greedy, never stopping early (the engine runs with ignore_eos)."""
    import torch

    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    # An empty EOS list: generation runs to max_new_tokens without suppressing
    # any token (None would fall back to the model's EOS and stop early).
    config.eos_token_id = []
    config.pad_token_id = 0
    config.max_new_tokens = new_tokens
    config.do_sample = False
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config)
    return out[0, len(prompt) :].tolist()


def run_hf_part(cfg: BenchConfig, ttft: dict, tput: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from worker.model.store import resolve_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model), dtype=dtype[cfg.dtype])
    model.to(cfg.device).eval()
    hf_greedy(model, tput["prompts"][0][:8], 4)  # warm-up
    started = time.perf_counter()
    outputs = [hf_greedy(model, p, cfg.new_tokens) for p in tput["prompts"]]
    elapsed = time.perf_counter() - started
    first_tokens = [hf_greedy(model, ttft[k], 1)[0] for k in ("cold_prompt", "hit_prompt")]
    return {"outputs": outputs, "elapsed_s": elapsed, "first_tokens": first_tokens}


def hf_reference(cfg: BenchConfig, prompts: list[list[int]], ttft_prompts: list[list[int]]) -> dict:
    """HF greedy outputs (and their timing) for the throughput and TTFT prompts."""
    return run_hf_part(
        cfg,
        {"cold_prompt": ttft_prompts[0], "hit_prompt": ttft_prompts[1]},
        {"prompts": prompts},
    )
