"""Causal attention for long prefill chunks on CPU, as oneDNN matmuls over query blocks.

PyTorch's CPU ``scaled_dot_product_attention`` was the largest part of a
long cold prefill (about half of a 2,048-token SmolLM2 prefill on an AMD
EPYC Zen 5) and about twice as slow again with an explicit mask, as a chunk
with earlier context needs. Here each block of ``QUERY_BLOCK`` queries of one
KV head's query heads is two plain products through oneDNN (the kernels the
packed projections already use): scores against the keys it may see, a
float32 softmax, then the values. Keys past the causal edge of the block are
never multiplied. On that host a 2,048-token layer took 24 ms against SDPA's
37, and a whole cold prefill 1.8-1.9 s against 2.2-2.5 s (docs/RESULTS.md, engine
section). On a Zen 4 EPYC, whose AVX-512 runs on 256-bit units, the two tie in
fp32 (39.6 against 39.8 ms a layer) and this is faster in bf16. Below
``MIN_CONTEXT`` keys SDPA is as fast or faster and is kept.

The key length of each product is rounded up to ``KEY_PAD`` (zero keys, their
scores masked): oneDNN builds a kernel for every new shape (0.3-0.9 ms each),
and rounded lengths recur from one prompt to the next.

bf16 follows Hugging Face's eager attention: bf16 scores, the softmax in
float32, the probabilities back in bf16 for the product with the values.

Which of the two is faster depends on the CPU and the dtype, so a worker times
both once as it warms up (``blocked_is_faster``) and keeps the faster. On an
Intel Xeon with AVX-512 and AMX (7 December 2026), SDPA took 28-33 ms a
2,048-token float32 layer against 45-72 ms here, and a whole cold prefill 3.3 s
against 3.95 s; in bf16, where SDPA runs on AMX, 10.5 ms against 37.9 ms.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from worker.model.llama import can_pack

QUERY_BLOCK = 128
KEY_PAD = 128
MIN_CONTEXT = 512


def use_blocked(
    device: torch.device, dtype: torch.dtype, context_len: int, faster: bool = True
) -> bool:
    """Whether a prefill chunk attending over ``context_len`` keys runs here, not in SDPA;
    ``faster``: whether this CPU runs it faster than SDPA (``blocked_is_faster``)."""
    return faster and device.type == "cpu" and context_len >= MIN_CONTEXT and can_pack(dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention output [n, heads, head_dim] for the last n positions of a causal sequence.

    q [n, heads, head_dim] holds positions ``past .. past + n - 1``, where
    ``past = len(k) - n``; k and v [past + n, kv_heads, head_dim] hold every
    position from 0. Query heads share KV heads in consecutive groups (GQA).
    """
    context, kv_heads, head_dim = k.shape
    # oneDNN is only fast on contiguous operands (a row-strided one took 2,000x
    # longer), so each head's keys and values are copied out once.
    keys = k.new_zeros(kv_heads, _padded(context), head_dim)
    keys[:, :context] = k.transpose(0, 1)
    values = torch.zeros_like(keys)
    values[:, :context] = v.transpose(0, 1)
    return attend(q, keys, values, context)


def gather_head_major(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``context`` keys and values [kv_heads, padded, head_dim], read
    from paged caches [num_blocks, block_size, kv_heads, head_dim] through its block ids.

    Each head's blocks are gathered straight into place: one copy, where gathering
    the blocks and then transposing them into this layout took two and a zero fill.
    """
    _, block_size, kv_heads, head_dim = k_cache.shape
    gathered = block_ids.numel() * block_size
    length = max(_padded(context), gathered)
    out = []
    for cache in (k_cache, v_cache):
        heads = cache.new_empty(kv_heads, length, head_dim)
        for head in range(kv_heads):
            place = heads[head, :gathered].view(-1, block_size, head_dim)
            torch.index_select(cache[:, :, head], 0, block_ids, out=place)
        # Slots past the context hold whatever the blocks held: the causal cut masks
        # their scores, and zeros keep a stale non-finite value out of the products.
        heads[:, context:].zero_()
        out.append(heads)
    return out[0], out[1]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int) -> torch.Tensor:
    """``causal_attention`` over head-major keys and values [kv_heads, >= padded, head_dim]."""
    n, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    past = context - n
    group = heads // kv_heads
    # [kv_heads, n, group, head_dim]: a block's rows (query, then group head) are one
    # contiguous slice, and its output rows land in ``out`` in the same order.
    queries = q.new_empty(kv_heads, n, group, head_dim)
    torch.mul(
        q.view(n, kv_heads, group, head_dim).transpose(0, 1), 1.0 / math.sqrt(head_dim), out=queries
    )
    # Row i of a block sees columns up to its own position: above the diagonal gets -inf.
    # Added, not masked_fill_ed: the same values (x + 0 == x), a quarter of the time.
    cut = torch.full((QUERY_BLOCK, QUERY_BLOCK + KEY_PAD), float("-inf"), dtype=q.dtype).triu_(1)
    out = q.new_empty(n, heads, head_dim)
    for head in range(kv_heads):
        for start in range(0, n, QUERY_BLOCK):
            end = min(n, start + QUERY_BLOCK)
            rows = end - start
            first = past + start  # first column the block's causal mask cuts
            seen = _padded(past + end)
            x = queries[head, start:end].view(rows * group, head_dim)
            scores = _matmul(x, keys[head, :seen]).view(rows, group, seen)
            scores[:, :, first:].add_(cut[:rows, None, : seen - first])
            if scores.dtype == torch.float32:
                probs = torch.softmax(scores, dim=-1)
            else:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
            o = _matmul(probs.view(rows * group, seen), values[head, :seen].t())
            out[start:end, head * group : (head + 1) * group] = o.view(rows, group, head_dim)
    return out


def blocked_is_faster(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, tokens: int, repeats: int = 3
) -> tuple[bool, float, float]:
    """Whether ``causal_attention`` beats SDPA on a cold prefill of ``tokens`` tokens
    here, and each one's best seconds over ``repeats`` runs (after one untimed run each,
    which builds oneDNN's kernels), on random CPU tensors of one layer's shape.

    The two are timed in turns, not one after the other: a worker's start-up can
    share the cores with something else for a moment (three of five workers started
    on a Zen 4 EPYC timed the query blocks at 79-80 ms a layer, then SDPA at 39; timed
    in turns, four took 39-49 against 39-41), and that moment then slows both alike
    instead of deciding which one is kept."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
        )

    runs = (lambda: causal_attention(q, k, v), sdpa)
    best = [math.inf, math.inf]
    with torch.inference_mode():
        for run in runs:
            run()
        for _ in range(repeats):
            for i, run in enumerate(runs):
                started = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - started)
    return best[0] < best[1], best[0], best[1]


def _padded(context: int) -> int:
    return -(-context // KEY_PAD) * KEY_PAD


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through oneDNN's inner product (weight [out, in])."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")
