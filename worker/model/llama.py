"""Llama-family model math: config parsing, weight loading, RoPE, norms, MLP.

Owns everything that depends on the checkpoint format of Hugging Face
Llama-style decoders (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with
per-head q/k norms, SmolLM). The paged attention and the KV cache live in
``worker.model.attention`` and ``worker.model.runner``; this module never sees a
block table.

Projections are fused at load time (q|k|v into one matrix, gate|up into one)
so a step runs two fewer matmuls per layer; each output element is still the
same dot product as Hugging Face computes.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a checkpoint, read from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeSpec
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_spec(config: dict[str, Any], max_pos: int) -> RopeSpec:
    # transformers 5 writes "rope_parameters"; older checkpoints write
    # "rope_theta" at the top level and an optional "rope_scaling" dict.
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"--model: rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("--model: partial_rotary_factor != 1 is not supported")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            config.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or max_pos
        ),
    )


def read_model_spec(model_dir: Path) -> ModelSpec:
    """Parses ``config.json`` (and ``generation_config.json`` for EOS ids)."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"--model: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"--model: hidden_act {act!r} is not supported (only silu)")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    max_pos = int(config.get("max_position_embeddings", 2048))
    eos: list[int] = []
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    eos += _as_ids(config.get("eos_token_id"))
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    return ModelSpec(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope=_rope_spec(config, max_pos),
        sliding_window=int(window) if window else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], computed the way transformers does (float32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(
    rope: RopeSpec, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] for every absolute position, in the compute dtype."""
    inv_freq = rope_inv_freq(rope, head_dim)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] by per-token cos/sin [T, 1, head_dim] (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and scaled in the model dtype, as transformers does."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


class _Checkpoint:
    """Lazy name → tensor view over every ``*.safetensors`` file in a folder."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"--model: no *.safetensors files in {model_dir}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                self._where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"--model: checkpoint has no tensor {name!r}")
        return self._where[name].get_tensor(name)


def load_weights(
    model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    """Reads the safetensors checkpoint into fused, device-resident tensors."""
    ckpt = _Checkpoint(model_dir)

    def tensor(name: str) -> torch.Tensor:
        return ckpt.get(name).to(device=device, dtype=dtype)

    def optional_cat(names: list[str]) -> torch.Tensor | None:
        if not all(n in ckpt for n in names):
            return None
        return torch.cat([tensor(n) for n in names])

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
        mlp = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
        layers.append(
            LayerWeights(
                input_norm=tensor(f"{p}input_layernorm.weight"),
                qkv=torch.cat([tensor(f"{n}.weight") for n in attn]),
                qkv_bias=optional_cat([f"{n}.bias" for n in attn]),
                o_proj=tensor(f"{p}self_attn.o_proj.weight"),
                o_bias=optional_cat([f"{p}self_attn.o_proj.bias"]),
                q_norm=optional_cat([f"{p}self_attn.q_norm.weight"]),
                k_norm=optional_cat([f"{p}self_attn.k_norm.weight"]),
                post_norm=tensor(f"{p}post_attention_layernorm.weight"),
                gate_up=torch.cat([tensor(f"{n}.weight") for n in mlp]),
                gate_up_bias=optional_cat([f"{n}.bias" for n in mlp]),
                down=tensor(f"{p}mlp.down_proj.weight"),
                down_bias=optional_cat([f"{p}mlp.down_proj.bias"]),
            )
        )
    embed = tensor("model.embed_tokens.weight")
    # Tied checkpoints may omit lm_head, and transformers ignores a saved one when tied.
    if "lm_head.weight" in ckpt and not spec.tie_word_embeddings:
        lm_head = tensor("lm_head.weight")
    else:
        if not spec.tie_word_embeddings:
            logger.warning("%s has no lm_head.weight: using the tied embedding", model_dir)
        lm_head = embed
    return ModelWeights(
        embed=embed, layers=layers, final_norm=tensor("model.norm.weight"), lm_head=lm_head
    )


def mlp(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
    gate_up = F.linear(x, w.gate_up, w.gate_up_bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down, w.down_bias)
