"""The query-block prefill kernel against PyTorch's SDPA, and when the runner picks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.llama import can_pack
from worker.model.prefill_attention import (
    MIN_CONTEXT,
    attend,
    causal_attention,
    gather_head_major,
    use_blocked,
)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not can_pack(torch.float32), reason="the kernel's products run through oneDNN"
)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bottom-right causal attention in float64 through SDPA's math path."""
    n, context = q.shape[0], k.shape[0]
    allowed = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None],
        k.double().transpose(0, 1)[None],
        v.double().transpose(0, 1)[None],
        attn_mask=allowed,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def random_qkv(n: int, past: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)

    def draw(rows: int, h: int) -> torch.Tensor:
        return torch.randn(rows, h, 64, generator=generator).to(dtype)

    return draw(n, heads), draw(past + n, kv_heads), draw(past + n, kv_heads)


@needs_onednn
@pytest.mark.parametrize(
    ("n", "past", "heads", "kv_heads"),
    [
        (1, 0, 9, 3),  # one token
        (129, 0, 9, 3),  # one query row past a block
        (600, 0, 4, 4),  # no head sharing
        (1030, 0, 9, 3),  # several blocks, keys not a multiple of the padding
        (64, 1984, 9, 3),  # a short chunk after a long cached prefix
        (300, 257, 8, 2),  # neither edge on a block
    ],
)
def test_float32_matches_sdpa(n: int, past: int, heads: int, kv_heads: int):
    q, k, v = random_qkv(n, past, heads, kv_heads, torch.float32, seed=n + past)
    out = causal_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), sdpa_reference(q, k, v), atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(
    not can_pack(torch.bfloat16), reason="bfloat16 takes the kernel only where oneDNN packs it"
)
def test_bfloat16_stays_within_bfloat16_rounding():
    q, k, v = random_qkv(700, 100, 9, 3, torch.bfloat16, seed=5)
    out = causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    # bf16 scores and probabilities, as HF's eager attention: a few bf16 ulps.
    torch.testing.assert_close(out.double(), sdpa_reference(q, k, v), atol=3e-2, rtol=3e-2)


@needs_onednn
def test_the_first_row_attends_only_to_the_first_key():
    q, k, v = random_qkv(MIN_CONTEXT, 0, 2, 1, torch.float32, seed=3)
    out = causal_attention(q, k, v)
    torch.testing.assert_close(out[0], v[0].expand(2, 64))


def test_the_runner_picks_it_only_for_long_cpu_chunks():
    packs = can_pack(torch.float32)
    assert use_blocked(CPU, torch.float32, MIN_CONTEXT) is packs
    assert not use_blocked(CPU, torch.float32, MIN_CONTEXT - 1)
    assert not use_blocked(torch.device("cuda"), torch.float32, 4 * MIN_CONTEXT)
    assert not use_blocked(CPU, torch.float16, 4 * MIN_CONTEXT)  # oneDNN packs no fp16 here


@needs_onednn
@pytest.mark.parametrize("block_size", [16, 48])  # 48: the blocks reach past the key padding
def test_paged_keys_gathered_head_major_give_the_same_output(block_size: int):
    """Keys and values read from paged caches straight into the kernel's layout."""
    n, past, kv_heads = 70, 530, 3
    q, k, v = random_qkv(n, past, 9, kv_heads, torch.float32, seed=7)
    context = past + n
    num_blocks = -(-context // block_size)
    generator = torch.Generator().manual_seed(8)
    ids = torch.randperm(40, generator=generator)[:num_blocks]  # scattered block ids
    caches = []
    for x in (k, v):
        cache = torch.full((40, block_size, kv_heads, 64), float("nan"))
        flat = torch.full((num_blocks * block_size, kv_heads, 64), float("nan"))  # stale slots
        flat[:context] = x
        cache[ids] = flat.view(num_blocks, block_size, kv_heads, 64)
        caches.append(cache)
    keys, values = gather_head_major(caches[0], caches[1], ids, context)
    assert keys.shape[1] >= -(-context // 128) * 128
    torch.testing.assert_close(keys[:, :context], k.transpose(0, 1), rtol=0, atol=0)
    assert not keys[:, context:].any() and not values[:, context:].any()
    assert torch.equal(attend(q, keys, values, context), causal_attention(q, k, v))
