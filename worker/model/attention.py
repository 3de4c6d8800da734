"""Paged attention: the per-step plan built from a batch of chunks, and the per-layer kernel.

A step's chunks are flattened into one token batch (so every linear layer
runs once per step). Attention is then done per group:

- a *cold* prefill chunk (``start_pos == 0``) attends over its own fresh K/V
  with a plain causal mask, exactly as a dense model would;
- a prefill chunk with earlier context gathers that context from the cache
  through its block table and uses a bottom-right-aligned causal mask
  (query i at absolute position ``start_pos + i`` sees keys ``0..start_pos + i``);
- on CPU, a prefill chunk attending over ``MIN_CONTEXT`` keys or more takes the
  query-block kernel of ``worker.model.prefill_attention`` instead of SDPA;
- all single-token (decode) chunks are batched into one padded call, each row
  masked to its own context length.

In the last layer only the rows whose logits are sampled need a query: every
other row's output there feeds nothing (its K/V are still written). When at
least ``TAIL_MIN_SKIPPED`` rows need none, the plan carries those rows as a
decode-style ``tail`` group (each reads its whole context from the cache), and
the runner skips the last layer's attention, output projection and MLP for
the rest: about 1/num_layers of a long prefill's work, outputs unchanged.

Everything that depends only on the chunks (slots, masks, block-table tensors)
is built once per step here, not once per layer.

An fp8 cache (``float8_e4m3fn``) keeps one float32 scale per token and KV
head beside the values: each head vector is divided by its own
``amax / 448`` before the cast, so the 3-bit mantissa is spent on the
vector's own range and nothing saturates (a plain cast clips SmolLM2's
large K outliers at 448, and only 41 % of free-running greedy tokens then
matched fp32). The scales cost 4 bytes per 64-value head vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.model.prefill_attention import (
    attend,
    causal_attention,
    gather_head_major,
    use_blocked,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Below this many rows without logits the tail's cache gather costs more than it saves.
TAIL_MIN_SKIPPED = 32


@dataclass
class LayerKV:
    """One layer's paged cache: K and V ``[num_blocks, block_size, kv_heads, head_dim]``.

    ``k_scale`` / ``v_scale`` ``[num_blocks, block_size, kv_heads]`` (float32)
    exist only for an fp8 cache: value = stored fp8 * scale.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
    ) -> LayerKV:
        # Zeroed, not empty: padded decode rows read unused slots (masked out),
        # and garbage NaNs there would poison the softmax.
        def zeros(s: tuple[int, ...], d: torch.dtype) -> torch.Tensor:
            return torch.zeros(s, dtype=d, device=device)

        if dtype != FP8:
            return cls(zeros(shape, dtype), zeros(shape, dtype))
        return cls(
            zeros(shape, FP8),
            zeros(shape, FP8),
            zeros(shape[:3], torch.float32),
            zeros(shape[:3], torch.float32),
        )


class Chunk(Protocol):
    """What the runner needs from ``worker.engine.batch.SeqChunk``."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool


@dataclass
class PrefillGroup:
    rows: slice
    ctx_len: int
    block_ids: torch.Tensor | None  # None: no earlier context, attend the chunk's own K/V
    mask: torch.Tensor | None  # [n, ctx_len] additive (0 / -inf), bottom-right causal, for SDPA
    blocked: bool  # causal attention by query blocks (worker.model.prefill_attention)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] rows of the token batch
    all_rows: bool  # rows == arange(num_tokens): skip the gather and scatter
    block_table: torch.Tensor  # [B, max_blocks], padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive (0 / -inf)


@dataclass
class StepPlan:
    num_tokens: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat cache slot of each token
    logits_rows: torch.Tensor  # [L] last row of each chunk that needs logits
    prefill: list[PrefillGroup]
    decode: DecodeGroup | None
    # The last layer's queries when only the logits rows need one (None: every row does)
    tail: DecodeGroup | None = None


def _check_chunk(chunk: Chunk, block_size: int, max_model_len: int) -> None:
    n = len(chunk.token_ids)
    end = chunk.start_pos + n
    if n == 0:
        raise ValueError("chunk has no tokens")
    if chunk.start_pos < 0 or end > max_model_len:
        raise ValueError(f"chunk positions [{chunk.start_pos}, {end}) exceed {max_model_len}")
    if len(chunk.block_table) * block_size < end:
        raise ValueError(
            f"block table of {len(chunk.block_table)} blocks cannot hold {end} positions"
        )


def build_plan(
    chunks: Sequence[Chunk],
    block_size: int,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    tail: bool = True,
    blocked_attention: bool = True,
) -> StepPlan:
    """Flattens chunks into one token batch and precomputes slots, masks and groups.

    Masks are additive in the compute ``dtype``: given a boolean mask, SDPA
    builds that float mask itself in every layer (about 10 % of a decode
    layer's attention call at batch 8); the result is bit for bit the same.
    ``tail`` False keeps the last layer on every row (a cache that does not
    hold the compute dtype's exact K/V, as fp8 does not). ``blocked_attention``
    False keeps long prefill chunks in SDPA (a CPU where it is the faster).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    prefill: list[PrefillGroup] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    logits_tables: list[list[int]] = []
    logits_lens: list[int] = []
    row = 0
    for chunk in chunks:
        _check_chunk(chunk, block_size, max_model_len)
        n = len(chunk.token_ids)
        start = chunk.start_pos
        table = chunk.block_table
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, start + n))
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, start + n)
        )
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(chunk.block_table)
            decode_lens.append(start + 1)
        else:
            ctx = start + n
            blocked = use_blocked(device, dtype, ctx, blocked_attention)
            block_ids = None
            mask = None
            if start > 0:
                ids = torch.tensor(table[: -(-ctx // block_size)], dtype=torch.long)
                block_ids = ids.to(device)
                if not blocked:
                    allowed = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
                    mask = _additive(allowed, dtype, device)
            prefill.append(PrefillGroup(slice(row, row + n), ctx, block_ids, mask, blocked))
        row += n
        if chunk.need_logits:
            logits_rows.append(row - 1)
            logits_tables.append(table)
            logits_lens.append(start + n)
    decode = None
    if decode_rows:
        decode = _decode_group(
            decode_rows, decode_tables, decode_lens, row, block_size, device, dtype
        )
    tail_group = None
    if tail and row - len(logits_rows) >= TAIL_MIN_SKIPPED:
        tail_group = _decode_group(
            logits_rows, logits_tables, logits_lens, row, block_size, device, dtype
        )
    return StepPlan(
        num_tokens=row,
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        prefill=prefill,
        decode=decode,
        tail=tail_group,
    )


def _decode_group(
    rows: list[int],
    tables: list[list[int]],
    lens: list[int],
    num_tokens: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DecodeGroup:
    """One query per row over its context of ``lens`` keys, read from the cache."""
    max_blocks = max((-(-length // block_size) for length in lens), default=1)
    padded = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]
    keys = torch.arange(max_blocks * block_size)
    mask = keys[None, :] < torch.tensor(lens, dtype=torch.long)[:, None]
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        all_rows=len(rows) == num_tokens,
        block_table=torch.tensor(padded, dtype=torch.long)
        .reshape(len(rows), max_blocks)
        .to(device),
        mask=_additive(mask[:, None, None, :], dtype, device),
    )


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, as SDPA adds it to the scores."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


def write_kv(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Stores K/V [T, kv_heads, head_dim] into their slots of the paged caches."""
    if cache.k_scale is not None and cache.v_scale is not None:
        _write_fp8(cache.k, cache.k_scale, k, slots)
        _write_fp8(cache.v, cache.v_scale, v, slots)
        return
    kv_heads, head_dim = k.shape[1], k.shape[2]
    cache.k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(cache.k.dtype))
    cache.v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(cache.v.dtype))


def _write_fp8(
    values: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
) -> None:
    """Per-(token, head) scaled cast; CPU kernels cannot index fp8, so bytes move as uint8."""
    kv_heads, head_dim = x.shape[1], x.shape[2]
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    quantized = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    values.view(torch.uint8).view(-1, kv_heads, head_dim).index_copy_(0, slots, quantized)
    scales.view(-1, kv_heads).index_copy_(0, slots, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    plan: StepPlan,
) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for q [T, heads, head_dim].

    k and v are this step's fresh keys and values, already written to the
    caches; cold prefill chunks use them directly, all others read the cache.
    """
    single = len(plan.prefill) + (plan.decode is not None) == 1
    out = None if single else torch.empty_like(q)
    for group in plan.prefill:
        result = _prefill_attention(q[group.rows], k[group.rows], v[group.rows], cache, group)
        if out is None:
            return result
        out[group.rows] = result
    decode = plan.decode
    if decode is None:
        if out is None:
            raise ValueError("a step plan needs at least one chunk")
        return out
    od = decode_attention(q if decode.all_rows else q.index_select(0, decode.rows), cache, decode)
    if out is None:
        return od
    out.index_copy_(0, decode.rows, od)
    return out


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, group: PrefillGroup
) -> torch.Tensor:
    """One prefill chunk's attention output [n, heads, head_dim]; k and v are its own."""
    if group.blocked and group.block_ids is not None and cache.k.dtype == q.dtype:
        # Straight from the cache into the kernel's layout: one copy instead of three.
        keys, values = gather_head_major(cache.k, cache.v, group.block_ids, group.ctx_len)
        return attend(q, keys, values, group.ctx_len)
    if group.block_ids is not None:
        k = _gather(cache.k, cache.k_scale, group.block_ids, q.dtype)[: group.ctx_len]
        v = _gather(cache.v, cache.v_scale, group.block_ids, q.dtype)[: group.ctx_len]
    if group.blocked:
        return causal_attention(q, k, v)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=group.mask,
        is_causal=group.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, cache: LayerKV, group: DecodeGroup) -> torch.Tensor:
    """Output [B, heads, head_dim] of the group's B queries, each over its cached context."""
    kd = _gather(cache.k, cache.k_scale, group.block_table, q.dtype)
    vd = _gather(cache.v, cache.v_scale, group.block_table, q.dtype)
    # The query heads sharing a KV head go in as that head's query rows ([B, kv_heads,
    # group, D]): one attention call per KV head instead of per query head, and no
    # expanded K/V. 2x faster than enable_gqa on SmolLM2's 9/3 heads at batch 8.
    batch, heads, head_dim = q.shape
    kv_heads = kd.shape[2]
    return F.scaled_dot_product_attention(
        q.view(batch, kv_heads, heads // kv_heads, head_dim),
        kd.transpose(1, 2),
        vd.transpose(1, 2),
        attn_mask=group.mask,
    ).reshape(batch, heads, head_dim)


def _gather(
    cache: torch.Tensor, scales: torch.Tensor | None, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Cache blocks by id, upcast to the compute dtype: [..., n * block_size, heads, dim].

    ``index_select`` on flat ids, because advanced indexing with a 2-D index
    is many times slower on CPU.
    """
    flat = block_ids.flatten()
    if scales is None:
        blocks = cache.index_select(0, flat)
        if blocks.dtype != dtype:
            blocks = blocks.to(dtype)
    else:
        raw = cache.view(torch.uint8).index_select(0, flat).view(FP8)
        blocks = (raw.float() * scales.index_select(0, flat)[..., None]).to(dtype)
    return blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])
