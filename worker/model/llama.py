"""Llama-family model math: config parsing, weight loading, RoPE, norms, MLP.

Owns everything that depends on the checkpoint format of Hugging Face
Llama-style decoders (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with
per-head q/k norms, SmolLM). The paged attention and the KV cache live in
``worker.model.attention`` and ``worker.model.runner``; this module never sees a
block table.

Projections are fused at load time (q|k|v into one matrix, gate|up into one)
so a step runs two fewer matmuls per layer; each output element is still the
same dot product as Hugging Face computes. On CPU every projection (and the
LM head) is also reordered once into oneDNN's blocked layout (``Linear``): a
decode step multiplies a handful of rows by each matrix, which is bound by
reading the weights, and the blocked layout streams them about twice as fast
as ``F.linear`` on the plain matrix (profiled: 60 % of a decode step).
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
    """Rotates x [T, heads, head_dim] by per-token cos/sin [T, 1, head_dim] (half-split layout).

    The same products and sums as transformers' ``x * cos + rotate_half(x) * sin``
    (both halves of the cos/sin rows are equal), written half by half into one
    output, so no negated and concatenated copy of x is built.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1)
    o1.sub_(x2 * s)
    torch.mul(x2, c, out=o2)
    o2.add_(x1 * s)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and scaled in the model dtype, as transformers does."""
    if x.dtype == torch.float32:
        # One call instead of three: the same products in the same order, and a
        # decode step runs 2 x layers + 1 of them (1.3 % of a SmolLM2 step).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class Linear:
    """``y = x W^T + b`` for x [T, in]; on CPU through a oneDNN-packed copy of W.

    ``weight`` is the plain [out, in] matrix (kept only when nothing else
    needs packing, or when it is shared, as a tied LM head is with the
    embedding). The packed copy is made once at load time; dtypes oneDNN
    cannot pack on this CPU (fp16 without AVX512-FP16) stay on ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, keep: bool) -> None:
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and can_pack(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.weight: torch.Tensor | None = weight if keep or self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        assert self.weight is not None  # kept whenever there is no packed copy
        return F.linear(x, self.weight, self.bias)


# oneDNN picks its blocking for this many rows; decode steps are a few rows.
PACK_BATCH_HINT = 8


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN has packed-weight kernels for ``dtype`` on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear


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

    def linear(names: list[str]) -> Linear:
        weight = torch.cat([tensor(f"{n}.weight") for n in names])
        return Linear(weight, optional_cat([f"{n}.bias" for n in names]), keep=False)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=tensor(f"{p}input_layernorm.weight"),
                qkv=linear([f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]),
                o_proj=linear([f"{p}self_attn.o_proj"]),
                q_norm=optional_cat([f"{p}self_attn.q_norm.weight"]),
                k_norm=optional_cat([f"{p}self_attn.k_norm.weight"]),
                post_norm=tensor(f"{p}post_attention_layernorm.weight"),
                gate_up=linear([f"{p}mlp.{n}_proj" for n in ("gate", "up")]),
                down=linear([f"{p}mlp.down_proj"]),
            )
        )
    embed = tensor("model.embed_tokens.weight")
    # Tied checkpoints may omit lm_head, and transformers ignores a saved one when tied.
    if "lm_head.weight" in ckpt and not spec.tie_word_embeddings:
        lm_head = Linear(tensor("lm_head.weight"), None, keep=False)
    else:
        if not spec.tie_word_embeddings:
            logger.warning("%s has no lm_head.weight: using the tied embedding", model_dir)
        lm_head = Linear(embed, None, keep=True)  # the embedding lookup still needs it
    return ModelWeights(
        embed=embed, layers=layers, final_norm=tensor("model.norm.weight"), lm_head=lm_head
    )


def mlp(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

    SiLU runs in place on the fused gate|up output: at prefill sizes every
    [T, intermediate] temporary is a visible share of the step.
    """
    gate, up = w.gate_up(x).chunk(2, dim=-1)
    return w.down(torch.mul(F.silu(gate, inplace=True), up))
