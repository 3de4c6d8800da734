"""FP8 KV cache agreement: how many free-running greedy tokens match the unquantized cache.

Runs ``--prompts`` chat prompts (fixed English instructions through the
model's chat template) through two in-process engines on the same weights
and dtype, one with ``kv_cache_dtype="auto"`` and one with ``"fp8"``, each
generating ``--new-tokens`` greedy tokens with ``ignore_eos``. Prints one
JSON object:

- ``agreement``: the share of token positions (first ``--new-tokens`` of every
  prompt) where the fp8 run's token equals the reference run's token
  (free-running: after a first flip the two texts usually part for good);
- ``exact_prefix_share``: the share of tokens before each prompt's first
  divergence, and ``per_prompt_first_divergence``;
- ``teacher_forced_agreement``: the fp8 cache fed the reference's own tokens,
  the share of steps whose argmax equals the reference's next token (the
  per-step fidelity, free of the compounding);
- ``bf16_kv``: the same figures for a bfloat16 cache under the same compute
  dtype, the floor any 8-bit cache is measured against;
- ``kv_bytes_per_token`` for each cache; ``target_met``: ``agreement >= --target``.

With ``--against vllm``, ``vllm`` holds the same figures for vLLM's own fp8
cache against its unquantized one (``loadtest.bench_fp8_kv_vllm``), and
``auto_vs_kvroute_auto``: how many of vLLM's unquantized tokens equal kvroute's.

Usage: ``python -m loadtest.bench_fp8_kv [--model smollm2] [--dtype float32]
[--prompts 20] [--new-tokens 256] [--against vllm]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from loadtest.fleet import sigterm_as_ctrl_c

INSTRUCTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
    "Give me three tips for getting better sleep.",
    "Summarize the causes of the French Revolution.",
    "How does a bicycle stay upright when it moves?",
    "Write a polite email asking a colleague to review a document.",
    "What is photosynthesis and why does it matter?",
    "List five healthy breakfast ideas and explain why each is good.",
    "Explain the difference between weather and climate.",
    "Write a haiku about autumn leaves, then explain its imagery.",
    "How do vaccines train the immune system?",
    "Describe how to plant a tomato seedling in a garden.",
    "What is a prime number? Give some examples.",
    "Explain what a database index is and when to use one.",
    "Tell me about the history of the printing press.",
    "What should someone pack for a three-day hiking trip?",
    "Explain how interest on a savings account works.",
    "Describe the life cycle of a butterfly.",
    "Why is the sky blue during the day and red at sunset?",
    "Write a short speech congratulating a team on finishing a project.",
    "How do airplanes generate lift?",
    "What are the benefits of learning a second language?",
]


def chat_prompts(model: str, n: int) -> list[list[int]]:
    """``n`` instructions rendered as single-turn chats, as token ids."""
    from transformers import AutoTokenizer

    from worker.model.store import resolve_model

    if not 1 <= n <= len(INSTRUCTIONS):
        raise ValueError(f"--prompts {n}: must be in 1..{len(INSTRUCTIONS)}")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    out = []
    for text in INSTRUCTIONS[:n]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


async def generate_all(
    model: str, dtype: str, kv_cache_dtype: str, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], int]:
    """Greedy outputs of every prompt (one batch) and the cache's bytes per token."""
    from contract.hashing import HashSpec
    from loadtest.bench_engine import run_request
    from worker.engine.thread import Engine, EngineConfig
    from worker.engine.torch_thread import TorchThread
    from worker.model.runner import ModelRunner

    block_size = 16
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // block_size)
    torch_thread = TorchThread()  # load and step on one thread, as the worker does
    runner = await torch_thread.run(
        ModelRunner,
        model,
        dtype=dtype,
        block_size=block_size,
        num_blocks=len(prompts) * per_seq + 8,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(
        runner,
        EngineConfig(max_num_seqs=len(prompts), max_batch_tokens=4096),
        hash_spec=HashSpec(block_size=block_size, model=runner.model_name),
    )
    engine.start(on=torch_thread)
    try:
        results = await asyncio.gather(
            *(run_request(engine, f"p{i}", p, new_tokens) for i, p in enumerate(prompts))
        )
    finally:
        engine.shutdown()
    return [r["tokens"] for r in results], runner.block_bytes // block_size


def teacher_forced(
    model: str, dtype: str, kv_cache_dtype: str, prompts: list[list[int]], refs: list[list[int]]
) -> float:
    """Share of steps whose argmax equals the reference token, fed the reference's tokens."""
    from worker.engine.batch import SeqChunk
    from worker.model.runner import ModelRunner

    n = min(len(r) for r in refs)
    block_size = 16
    sizes = [-(-(len(p) + n) // block_size) for p in prompts]
    runner = ModelRunner(
        model, dtype=dtype, block_size=block_size, num_blocks=sum(sizes) + 1,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    tables = [list(range(s, s + k)) for s, k in zip(starts, sizes, strict=True)]
    chunks = [SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    agree = 0
    for i in range(n):
        predicted = runner.execute(chunks).argmax(dim=-1).tolist()
        agree += sum(a == r[i] for a, r in zip(predicted, refs, strict=True))
        chunks = [
            SeqChunk([r[i]], len(p) + i, t, True)
            for p, r, t in zip(prompts, refs, tables, strict=True)
        ]
    return round(agree / (n * len(refs)), 4)


def compare(reference: list[list[int]], other: list[list[int]], n: int) -> dict[str, Any]:
    same = total = prefix = 0
    first: list[int | None] = []
    for ref, out in zip(reference, other, strict=True):
        pairs = list(zip(ref[:n], out[:n], strict=True))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
        diverge = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        first.append(diverge)
        prefix += len(pairs) if diverge is None else diverge
    return {
        "agreement": round(same / total, 4),
        "exact_prefix_share": round(prefix / total, 4),
        "per_prompt_first_divergence": first,
        "prompts_identical": sum(d is None for d in first),
    }


def vllm_agreement(
    args: argparse.Namespace, prompts: list[list[int]], kvroute_ref: list[list[int]]
) -> dict[str, Any]:
    """vLLM's fp8 cache against vLLM's unquantized one, measured as kvroute's is; and
    how far vLLM's unquantized outputs agree with kvroute's (the two references)."""
    from loadtest.bench_fp8_kv_vllm import vllm_outputs
    from worker.model.store import resolve_model

    model_dir = resolve_model(args.model)
    auto = asyncio.run(vllm_outputs(model_dir, args.dtype, "auto", prompts, args.new_tokens))
    fp8 = asyncio.run(vllm_outputs(model_dir, args.dtype, "fp8", prompts, args.new_tokens))
    return {
        "kv_cache_dtype": "fp8 (vLLM CPU, e4m3, default scale 1.0)",
        **compare(auto, fp8, args.new_tokens),
        "auto_vs_kvroute_auto": compare(kvroute_ref, auto, args.new_tokens)["agreement"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument(
        "--against",
        choices=["vllm"],
        help="also run vLLM (from .venv-vllm) with kv auto and fp8 on the same prompts",
    )
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens {args.new_tokens}: must be >= 1")
    with sigterm_as_ctrl_c():  # --against vllm starts vLLM servers
        result = _measure(args)
    print(json.dumps(result, indent=2))  # the benchmark's output is its JSON
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    prompts = chat_prompts(args.model, args.prompts)
    ref, ref_bytes = asyncio.run(
        generate_all(args.model, args.dtype, "auto", prompts, args.new_tokens)
    )
    fp8, fp8_bytes = asyncio.run(
        generate_all(args.model, args.dtype, "fp8", prompts, args.new_tokens)
    )
    bf16, bf16_bytes = asyncio.run(
        generate_all(args.model, args.dtype, "bfloat16", prompts, args.new_tokens)
    )
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_dtype": "fp8 (e4m3, float32 scale per token and KV head)",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        **compare(ref, fp8, args.new_tokens),
        "teacher_forced_agreement": teacher_forced(args.model, args.dtype, "fp8", prompts, ref),
        "bf16_kv": {
            **compare(ref, bf16, args.new_tokens),
            "teacher_forced_agreement": teacher_forced(
                args.model, args.dtype, "bfloat16", prompts, ref
            ),
        },
        "kv_bytes_per_token": {"auto": ref_bytes, "fp8": fp8_bytes, "bfloat16": bf16_bytes},
    }
    if args.against == "vllm":
        result["vllm"] = vllm_agreement(args, prompts, ref)
    result["target"] = args.target
    result["target_met"] = result["agreement"] >= args.target
    return result


if __name__ == "__main__":
    sys.exit(main())
