"""ModelRunner: owns the weights and the paged KV cache, and runs one step of chunks.

The runner knows nothing about sequences or scheduling: each step it gets
``SeqChunk``s (tokens, their absolute start position, the block table that
covers them), writes their K/V into the cache slots the block table names,
and returns float32 logits for the chunks that asked for them. A prompt whose
prefix is already in the cache therefore computes only its suffix.

KV tensors are ``[num_blocks, block_size, kv_heads, head_dim]`` per layer, for
K and for V; with ``kv_cache_dtype="fp8"`` they are stored as
``float8_e4m3fn`` with a float32 scale per token and KV head
(``worker.model.attention.LayerKV``) and upcast on read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.model.attention import (
    Chunk,
    LayerKV,
    StepPlan,
    build_plan,
    decode_attention,
    paged_attention,
    write_kv,
)
from worker.model.llama import (
    LayerWeights,
    ModelSpec,
    apply_rope,
    can_pack,
    load_weights,
    mlp,
    read_model_spec,
    rms_norm,
    rope_tables,
)
from worker.model.prefill_attention import MIN_CONTEXT, blocked_is_faster, use_blocked
from worker.model.store import resolve_model

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "bfloat16" (a 16-bit cache under fp32 compute) is the reference loadtest.bench_fp8_kv
# measures fp8 against; the worker's flag offers auto and fp8.
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16")
DEFAULT_CPU_MEMORY_FRACTION = 0.1
DEFAULT_CUDA_MEMORY_FRACTION = 0.9
# On CPU the KV cache competes with everything else on the host; more than
# this is rarely useful for the small models a CPU can serve.
CPU_KV_CACHE_CAP_BYTES = 4 << 30
# Capacity beyond this many full-length sequences only costs memory.
MAX_FULL_SEQUENCES = 256


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        logger.debug("no /proc/meminfo; using sysconf for available memory")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _parse_device(device: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]") from err
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available on this host")
    return parsed


@dataclass
class _WarmUpChunk:
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool


class ModelRunner:
    """Runs Llama-family checkpoints over a paged KV cache (see module docstring)."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_fraction: float | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if block_size < 1:
            raise ValueError(f"--block-size {block_size}: must be >= 1")
        self.device = _parse_device(device)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}.get(
            kv_cache_dtype, self.dtype
        )
        path = resolve_model(str(model_dir))
        self.spec: ModelSpec = read_model_spec(path)
        spec = self.spec
        self.model_name = path.name
        self.block_size = block_size
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = spec.eos_token_ids
        self.max_model_len = spec.max_position_embeddings
        if spec.sliding_window is not None and spec.sliding_window < self.max_model_len:
            # Within the window, sliding-window attention equals full attention.
            logger.info("capping max_model_len at the sliding window %d", spec.sliding_window)
            self.max_model_len = spec.sliding_window
        self.weights = load_weights(path, spec, self.dtype, self.device)
        if (
            self.device.type == "cpu"
            and self.weights.lm_head.packed is None
            and can_pack(torch.float32)
        ):
            # Measured on an AVX2-only EPYC: a 2,048-token prefill 4.7x slower in
            # bfloat16 than in float32 (46.8 against 9.9 s), decode 2.7x slower.
            logger.warning(
                "--dtype %s: oneDNN has no packed-weight kernels for it on this CPU "
                "(bfloat16 needs AVX512-BF16 or AMX), so every matmul takes a slower "
                "path; float32 may be several times faster here",
                dtype,
            )
        self._cos, self._sin = rope_tables(
            spec.rope, spec.head_dim, self.max_model_len, self.dtype, self.device
        )
        self.num_blocks = self._capacity(num_blocks, memory_fraction)
        shape = (self.num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = [
            LayerKV.allocate(shape, self.kv_dtype, self.device) for _ in range(spec.num_layers)
        ]
        # Long prefill chunks by query blocks unless warm_up finds SDPA faster here.
        self.blocked_attention = True
        logger.info(
            "loaded %s (%s) on %s as %s: %d layers, %d KV blocks of %d tokens, kv cache %s",
            self.model_name,
            spec.model_type,
            self.device,
            dtype,
            spec.num_layers,
            self.num_blocks,
            block_size,
            kv_cache_dtype,
        )

    @property
    def k_caches(self) -> list[torch.Tensor]:
        return [layer.k for layer in self.kv]

    @property
    def v_caches(self) -> list[torch.Tensor]:
        return [layer.v for layer in self.kv]

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V (fp8: with their scales)."""
        spec = self.spec
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        per_head = spec.head_dim * elem + (4 if self.kv_dtype == torch.float8_e4m3fn else 0)
        return 2 * spec.num_layers * self.block_size * spec.num_kv_heads * per_head

    def _capacity(self, num_blocks: int | None, memory_fraction: float | None) -> int:
        """Blocks to allocate: ``num_blocks`` if given, else a fraction of free memory."""
        if num_blocks is not None:
            if num_blocks < 1:
                raise ValueError(f"--num-blocks {num_blocks}: must be >= 1")
            return num_blocks
        cuda = self.device.type == "cuda"
        if memory_fraction is None:
            memory_fraction = DEFAULT_CUDA_MEMORY_FRACTION if cuda else DEFAULT_CPU_MEMORY_FRACTION
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"--memory-fraction {memory_fraction}: must be in (0, 1]")
        if cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * memory_fraction)
        else:
            budget = min(int(_available_ram_bytes() * memory_fraction), CPU_KV_CACHE_CAP_BYTES)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        blocks = min(budget // self.block_bytes, MAX_FULL_SEQUENCES * blocks_per_seq)
        if blocks < 1:
            raise ValueError(
                f"--memory-fraction {memory_fraction}: leaves no room for one KV block "
                f"({self.block_bytes} bytes); raise it or set --num-blocks"
            )
        if blocks < blocks_per_seq:
            logger.warning(
                "%d KV blocks cannot hold one %d-token sequence", blocks, self.max_model_len
            )
        return int(blocks)

    def warm_up(self, num_tokens: int) -> int:
        """One throwaway prefill of up to ``num_tokens`` (capped by the cache and context)
        before serving, as vLLM's profile run does: oneDNN builds its kernels for those
        shapes and the allocator reaches its high-water mark (``worker.model.host_memory``)
        on this step instead of the first request's. Returns the tokens it ran.

        It first writes every page of the KV cache: ``torch.zeros`` on CPU maps lazily
        zeroed pages, and each block's first use would otherwise fault its 1.5 MB
        (SmolLM2, block 32) during a request. Its K/V lands in blocks the pool has not
        handed out yet, and it hashes nothing, so no cached block changes. It first
        picks the faster prefill attention for this CPU and dtype.
        """
        for layer in self.kv:
            for tensor in (layer.k, layer.v, layer.k_scale, layer.v_scale):
                if tensor is not None:
                    tensor.zero_()
        n = min(num_tokens, self.max_model_len, self.num_blocks * self.block_size)
        if n < 1:
            return 0
        self._choose_prefill_attention(n)
        table = list(range(-(-n // self.block_size)))
        self.execute([_WarmUpChunk([0] * n, 0, table, True)])
        return n

    def _choose_prefill_attention(self, num_tokens: int) -> None:
        """Times the query-block kernel against SDPA on one layer's cold prefill of
        ``num_tokens`` (at least ``MIN_CONTEXT``, at most 2,048) and keeps the faster.

        The faster differs by CPU and dtype: on an AMD Zen 5 the kernel ran a 2,048-token
        layer 1.5x faster than SDPA; on an Intel Xeon with AMX it was 1.6x slower in
        float32 and 3.6x slower in bf16, where SDPA runs on AMX (module docstring of
        ``worker.model.prefill_attention``). In bf16 the kernel rounds as Hugging Face's
        eager attention does and SDPA does not; greedy bf16 text is not token-identical
        to HF's on every CPU either way, so bf16 takes the faster too.
        """
        if not use_blocked(self.device, self.dtype, MIN_CONTEXT):
            return
        spec, tokens = self.spec, min(max(num_tokens, MIN_CONTEXT), 2048)
        faster, blocked_s, sdpa_s = blocked_is_faster(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, self.dtype, tokens
        )
        self.blocked_attention = faster
        logger.info(
            "prefill attention: %s (query blocks %.1f ms, SDPA %.1f ms a %d-token layer)",
            "query blocks" if faster else "SDPA",
            blocked_s * 1000,
            sdpa_s * 1000,
            tokens,
        )

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Runs one step; float32 logits [chunks with need_logits, vocab] on the runner's device.

        Raises ValueError for a chunk whose positions exceed ``max_model_len``
        or whose block table does not cover them.
        """
        spec = self.spec
        if not chunks:
            return torch.empty(0, self.vocab_size, device=self.device)
        plan = build_plan(
            chunks,
            self.block_size,
            self.max_model_len,
            self.device,
            self.dtype,
            tail=self.kv_dtype == self.dtype,  # the tail reads K/V back from the cache
            blocked_attention=self.blocked_attention,
        )
        cos = self._cos[plan.positions].unsqueeze(1)
        sin = self._sin[plan.positions].unsqueeze(1)
        eps = spec.rms_norm_eps
        hidden = F.embedding(plan.input_ids, self.weights.embed)
        layers = list(zip(self.weights.layers, self.kv, strict=True))
        every_row = layers[:-1] if plan.tail is not None else layers
        for layer, cache in every_row:
            q, k, v = self._qkv(
                rms_norm(hidden, layer.input_norm, eps), layer, cache, plan, cos, sin
            )
            attn = paged_attention(q, k, v, cache, plan)
            hidden += layer.o_proj(attn.reshape(plan.num_tokens, -1))
            hidden += mlp(rms_norm(hidden, layer.post_norm, eps), layer)
        if plan.tail is None:
            last = hidden.index_select(0, plan.logits_rows)
        else:
            last = self._last_layer_tail(hidden, *layers[-1], plan, cos, sin)
        last = rms_norm(last, self.weights.final_norm, eps)
        return self.weights.lm_head(last).float()

    def _last_layer_tail(
        self,
        hidden: torch.Tensor,
        layer: LayerWeights,
        cache: LayerKV,
        plan: StepPlan,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The last layer's output for the logits rows only; every row's K/V still stored."""
        tail = plan.tail
        assert tail is not None
        eps = self.spec.rms_norm_eps
        q, _, _ = self._qkv(rms_norm(hidden, layer.input_norm, eps), layer, cache, plan, cos, sin)
        rows = hidden.index_select(0, tail.rows)
        if rows.shape[0] == 0:
            return rows
        attn = decode_attention(q.index_select(0, tail.rows), cache, tail)
        rows += layer.o_proj(attn.reshape(rows.shape[0], -1))
        rows += mlp(rms_norm(rows, layer.post_norm, eps), layer)
        return rows

    def _qkv(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        cache: LayerKV,
        plan: StepPlan,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q, k and v [T, heads, head_dim] of x [T, hidden]; k and v stored in the cache."""
        spec = self.spec
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        num_tokens = x.shape[0]
        qkv = layer.qkv(x)
        qk_width = (heads + kv_heads) * head_dim
        qk = qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim)
        v = qkv[:, qk_width:].view(num_tokens, kv_heads, head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            # Qwen3 normalises each head of q and k before the rotation.
            eps = spec.rms_norm_eps
            q_normed = rms_norm(qk[:, :heads], layer.q_norm, eps)
            qk = torch.cat((q_normed, rms_norm(qk[:, heads:], layer.k_norm, eps)), dim=1)
        # q and k share each token's rotation: rotate them in one pass.
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        write_kv(cache, k, v, plan.slots)
        return q, k, v
