"""The paged runner against Hugging Face transformers on the same checkpoints (fp32).

Every test computes through block tables and compares with the dense HF
model: cold prompts, prompts split into chunks (a prefix computed earlier, or
shared with another sequence through its blocks), mixed prefill/decode
batches, and greedy decoding against ``generate``.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from worker.engine.batch import SeqChunk
from worker.model.attention import build_plan
from worker.model.runner import ModelRunner

# loadtest/gpu_check.sh runs this module with KVROUTE_TEST_DEVICE=cuda.
DEVICE = os.environ.get("KVROUTE_TEST_DEVICE", "cpu")
ATOL = 2e-4
RTOL = 1e-4
MODELS = ["tiny_llama", "tiny_qwen2", "smollm2"]

HFLoader = Callable[[Path], torch.nn.Module]


def make_runner(path: Path | str, **kwargs: object) -> ModelRunner:
    kwargs.setdefault("device", DEVICE)
    return ModelRunner(path, **kwargs)  # type: ignore[arg-type]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kwargs: float) -> None:
    """``torch.testing.assert_close`` across devices (the HF reference stays on CPU)."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **kwargs)


@pytest.fixture(scope="module")
def hf_model() -> HFLoader:
    """Loads each HF reference model once per module."""
    from transformers import AutoModelForCausalLM

    loaded: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return load


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Dense logits [len(ids), vocab] for every position of ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def blocks(first: int, length: int, block_size: int) -> list[int]:
    """A block table of consecutive ids starting at ``first`` for ``length`` positions."""
    return list(range(first, first + -(-length // block_size)))


def model_dir(request: pytest.FixtureRequest, name: str) -> Path:
    return request.getfixturevalue(name)


@pytest.mark.parametrize("name", MODELS)
def test_cold_prompt_in_one_chunk(request: pytest.FixtureRequest, hf_model: HFLoader, name: str):
    path = model_dir(request, name)
    runner = make_runner(path, block_size=4, num_blocks=32)
    ids = prompt(runner.vocab_size, 37, seed=1)
    out = runner.execute([SeqChunk(ids, 0, blocks(5, 37, 4), need_logits=True)])
    assert out.shape == (1, runner.vocab_size) and out.dtype == torch.float32
    assert_close(out[0], hf_logits(hf_model(path), ids)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_in_several_chunks(request: pytest.FixtureRequest, hf_model: HFLoader, name: str):
    path = model_dir(request, name)
    runner = make_runner(path, block_size=4, num_blocks=32)
    ids = prompt(runner.vocab_size, 41, seed=2)
    ref = hf_logits(hf_model(path), ids)
    # Scattered, non-consecutive block ids prove reads follow the block table.
    table = [9, 2, 17, 0, 30, 11, 4, 25, 13, 6, 19]
    cuts = [0, 13, 16, 30, 41]  # boundaries inside and on block edges
    for start, end in itertools.pairwise(cuts):
        out = runner.execute([SeqChunk(ids[start:end], start, table, need_logits=True)])
        assert_close(out[0], ref[end - 1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_prefix_shared_through_blocks(
    request: pytest.FixtureRequest, hf_model: HFLoader, name: str
):
    """A second prompt reuses the first's full blocks and computes only its own suffix."""
    path = model_dir(request, name)
    runner = make_runner(path, block_size=4, num_blocks=32)
    first = prompt(runner.vocab_size, 30, seed=3)
    second = first[:24] + prompt(runner.vocab_size, 9, seed=4)
    runner.execute([SeqChunk(first, 0, blocks(0, 30, 4), need_logits=True)])
    table = blocks(0, 24, 4) + blocks(20, 9, 4)  # 6 shared blocks, then its own
    out = runner.execute([SeqChunk(second[24:], 24, table, need_logits=True)])
    assert_close(out[0], hf_logits(hf_model(path), second)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_mixed_prefill_and_decode_batch(
    request: pytest.FixtureRequest, hf_model: HFLoader, name: str
):
    path = model_dir(request, name)
    hf = hf_model(path)
    runner = make_runner(path, block_size=4, num_blocks=64)
    seqs = [prompt(runner.vocab_size, n, seed=10 + n) for n in (5, 18, 33, 12, 26)]
    tables = [blocks(12 * i, 48, 4) for i in range(5)]
    # Step 1: seqs 0 and 1 prefill fully, seq 2 only its first 20 tokens (no logits).
    runner.execute(
        [
            SeqChunk(seqs[0], 0, tables[0], True),
            SeqChunk(seqs[1], 0, tables[1], True),
            SeqChunk(seqs[2][:20], 0, tables[2], False),
        ]
    )
    # Step 2: two decodes, a prefill suffix, a cold prefill that ends early, a cold one.
    seqs[0].append(7)
    seqs[1].append(11)
    out = runner.execute(
        [
            SeqChunk([7], 5, tables[0], True),
            SeqChunk([11], 18, tables[1], True),
            SeqChunk(seqs[2][20:], 20, tables[2], True),
            SeqChunk(seqs[3][:9], 0, tables[3], False),
            SeqChunk(seqs[4], 0, tables[4], True),
        ]
    )
    assert out.shape == (4, runner.vocab_size)
    for row, seq in zip(out, [seqs[0], seqs[1], seqs[2], seqs[4]], strict=True):
        assert_close(row, hf_logits(hf, seq)[-1], atol=ATOL, rtol=RTOL)


def greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    new_tokens: int,
    tables: list[list[int]] | None = None,
    cached: list[int] | None = None,
) -> list[list[int]]:
    """Greedy-decodes every prompt together, one batch per step, stopping at EOS.

    ``cached[i]`` leading tokens of prompt i are already in the blocks of ``tables[i]``.
    """
    if tables is None:
        tables = [
            blocks(40 * i, len(p) + new_tokens, runner.block_size) for i, p in enumerate(prompts)
        ]
    cached = cached or [0] * len(prompts)
    chunks = [SeqChunk(p[c:], c, t, True) for p, t, c in zip(prompts, tables, cached, strict=True)]
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(new_tokens):
        tokens = runner.execute(chunks).argmax(dim=-1).tolist()
        for i, token in zip(live, tokens, strict=True):
            outputs[i].append(token)
        live = [i for i in live if outputs[i][-1] not in runner.eos_token_ids]
        chunks = [
            SeqChunk([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i], True)
            for i in live
        ]
        if not live:
            break
    return outputs


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf_generate(request: pytest.FixtureRequest, hf_model: HFLoader, name: str):
    path = model_dir(request, name)
    hf = hf_model(path)
    runner = make_runner(path, block_size=4, num_blocks=160)
    prompts = [prompt(runner.vocab_size, n, seed=20 + n) for n in (7, 19, 12)]
    got = greedy(runner, prompts, new_tokens=20)
    for ids, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert tokens == ref
    assert sum(len(t) for t in got) > 20  # not all stopped at once


def test_greedy_chat_prompt_on_smollm2(smollm2: Path, hf_model: HFLoader):
    """A real chat prompt: SmolLM2 must answer exactly as HF does, cold and after a prefix hit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = hf_model(smollm2).generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    expected = ref[0, len(ids) :].tolist()
    assert "Paris" in tokenizer.decode(expected)
    runner = make_runner(smollm2, block_size=16, num_blocks=16)
    assert greedy(runner, [ids], 20, tables=[[0, 1, 2, 3, 4]])[0] == expected
    # Same prompt again: its full blocks are reused, only the tail is computed.
    full = len(ids) // 16
    table = [0, 1, 2, 3, 4][:full] + [8, 9, 10, 11, 12][: 5 - full]
    assert full >= 1
    assert greedy(runner, [ids], 20, tables=[table], cached=[full * 16])[0] == expected


def test_fp8_kv_cache_agrees_with_fp32(smollm2: Path):
    """fp8 K/V: teacher-forced on fp32's greedy text, the argmax mostly agrees."""
    exact = make_runner(smollm2, block_size=16, num_blocks=24)
    fp8 = make_runner(smollm2, block_size=16, num_blocks=24, kv_cache_dtype="fp8")
    assert fp8.k_caches[0].dtype == torch.float8_e4m3fn
    ids = prompt(exact.vocab_size, 40, seed=5)
    reference = greedy(exact, [ids], 24)[0]
    full = ids + reference
    table = blocks(0, len(full), 16)
    out = fp8.execute([SeqChunk(full, 0, table, False)])
    assert out.shape == (0, fp8.vocab_size)
    # Teacher forcing: re-run the continuation one token at a time over the fp8 cache.
    agree = 0
    fp8_runner_tokens = []
    for i in range(len(reference)):
        pos = len(ids) + i - 1
        logits = fp8.execute([SeqChunk([full[pos]], pos, table, True)])
        fp8_runner_tokens.append(int(logits.argmax()))
        agree += fp8_runner_tokens[-1] == reference[i]
    assert torch.isfinite(logits).all()
    assert agree / len(reference) >= 0.75


def _random_checkpoint(out_dir: Path, config: object) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0)
    model.save_pretrained(out_dir)
    return out_dir


def test_qwen3_q_k_norm(tmp_path: Path, hf_model: HFLoader):
    from transformers import AutoTokenizer, Qwen3Config

    from tests.models import qwen3_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads: the runner must read it from the config
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    path = _random_checkpoint(tmp_path / "tiny-qwen3", config)
    runner = make_runner(path, block_size=4, num_blocks=32)
    assert runner.weights.layers[0].q_norm is not None
    ids = tokenizer("The paged KV cache holds every prefix once.")["input_ids"] * 3
    ref = hf_logits(hf_model(path), ids)
    table = blocks(3, len(ids), 4)
    first = runner.execute([SeqChunk(ids[:17], 0, table, True)])
    rest = runner.execute([SeqChunk(ids[17:], 17, table, True)])
    assert_close(first[0], ref[16], atol=ATOL, rtol=RTOL)
    assert_close(rest[0], ref[-1], atol=ATOL, rtol=RTOL)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path: Path, hf_model: HFLoader):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    path = _random_checkpoint(tmp_path / "tiny-llama3", config)
    runner = make_runner(path, block_size=8, num_blocks=40)
    assert runner.weights.lm_head.weight is runner.weights.embed
    ids = prompt(300, 200, seed=6)
    table = blocks(0, 200, 8)
    runner.execute([SeqChunk(ids[:150], 0, table, False)])
    out = runner.execute([SeqChunk(ids[150:], 150, table, True)])
    assert_close(out[0], hf_logits(hf_model(path), ids)[-1], atol=ATOL, rtol=RTOL)


def test_bfloat16_runs_close_to_float32(tiny_llama: Path):
    ids = prompt(1000, 24, seed=7)
    chunk = SeqChunk(ids, 0, blocks(0, 24, 4), True)
    exact = make_runner(tiny_llama, block_size=4, num_blocks=8).execute([chunk])
    half = make_runner(tiny_llama, dtype="bfloat16", block_size=4, num_blocks=8).execute([chunk])
    assert half.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(exact, half).item() > 0.99


def test_attributes(smollm2: Path, tiny_qwen2: Path):
    runner = make_runner(smollm2, block_size=16, num_blocks=10)
    assert runner.model_name == "SmolLM2-135M-Instruct"
    assert (runner.vocab_size, runner.max_model_len, runner.eos_token_ids) == (49152, 8192, (2,))
    assert runner.k_caches[0].shape == (10, 16, 3, 64) and len(runner.v_caches) == 30
    assert make_runner(tiny_qwen2, num_blocks=1).eos_token_ids == (151645,)


def test_capacity_from_memory_fraction(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch):
    # 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    monkeypatch.setattr("worker.model.runner._available_ram_bytes", lambda: 300 * block_bytes)
    runner = make_runner(tiny_llama, block_size=16, memory_fraction=0.5)
    assert runner.block_bytes == block_bytes
    assert runner.num_blocks == 150 and runner.k_caches[1].shape[0] == 150
    with pytest.raises(ValueError, match="--memory-fraction"):
        make_runner(tiny_llama, block_size=16, memory_fraction=0.001)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"dtype": "float64"}, "--dtype"),
        ({"kv_cache_dtype": "int4"}, "--kv-cache-dtype"),
        ({"device": "tpu"}, "--device"),
        ({"num_blocks": 0}, "--num-blocks"),
        ({"memory_fraction": 1.5}, "--memory-fraction"),
        ({"block_size": 0}, "--block-size"),
    ],
)
def test_bad_config_names_the_flag(tiny_llama: Path, kwargs: dict, flag: str):
    with pytest.raises(ValueError, match=flag):
        make_runner(tiny_llama, **kwargs)


def test_chunk_outside_its_block_table_is_refused(tiny_llama: Path):
    runner = make_runner(tiny_llama, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="block table"):
        runner.execute([SeqChunk(list(range(9)), 0, [0, 1], True)])
    with pytest.raises(ValueError, match="exceed"):
        runner.execute([SeqChunk([1], 4096, list(range(8)) * 200, True)])


@pytest.mark.skipif(DEVICE != "cpu", reason="oneDNN packing is a CPU path")
def test_a_dtype_this_cpu_cannot_pack_is_warned_about(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    caplog.set_level("WARNING", logger="worker.model.runner")
    make_runner(tiny_llama, block_size=4, num_blocks=8)
    assert not [r for r in caplog.records if "no packed-weight kernels" in r.getMessage()]
    # A CPU without AVX512-BF16: bfloat16 weights stay unpacked.
    monkeypatch.setattr("worker.model.llama.can_pack", lambda dtype: dtype == torch.float32)
    runner = make_runner(tiny_llama, block_size=4, num_blocks=8, dtype="bfloat16")
    assert runner.weights.lm_head.packed is None
    warned = [
        r.getMessage() for r in caplog.records if "no packed-weight kernels" in r.getMessage()
    ]
    assert warned and "--dtype bfloat16" in warned[0]


@pytest.mark.parametrize("blocked", [True, False], ids=["query_blocks", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_long_prompt_in_either_prefill_attention_matches_hf(
    request: pytest.FixtureRequest, hf_model: HFLoader, name: str, blocked: bool
):
    """Past ``MIN_CONTEXT`` keys a CPU prefill leaves SDPA for the query-block kernel,
    or stays in SDPA where ``warm_up`` found it faster (``blocked_attention`` off): both
    match HF, cold and after a cached prefix."""
    from worker.model.prefill_attention import MIN_CONTEXT

    path = model_dir(request, name)
    runner = make_runner(path, block_size=16, num_blocks=64)
    runner.blocked_attention = blocked
    length = MIN_CONTEXT + 150
    ids = prompt(runner.vocab_size, length, seed=30)
    ref = hf_logits(hf_model(path), ids)
    cached = 640  # whole blocks, then a chunk past a block edge
    first = SeqChunk(ids[:cached], 0, blocks(0, cached, 16), True)
    rest = SeqChunk(ids[cached:], cached, blocks(0, length, 16), True)
    if runner.device.type == "cpu":
        plans = [
            build_plan(
                [c],
                16,
                runner.max_model_len,
                runner.device,
                runner.dtype,
                blocked_attention=blocked,
            )
            for c in (first, rest)
        ]
        assert [p.prefill[0].blocked for p in plans] == [blocked, blocked]
    assert_close(runner.execute([first])[0], ref[cached - 1], atol=ATOL, rtol=RTOL)
    assert_close(runner.execute([rest])[0], ref[-1], atol=ATOL, rtol=RTOL)
    whole = make_runner(path, block_size=16, num_blocks=64)
    whole.blocked_attention = blocked
    out = whole.execute([SeqChunk(ids, 0, blocks(0, length, 16), True)])
    assert_close(out[0], ref[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(DEVICE != "cpu", reason="the choice is made on CPU only")
def test_warm_up_keeps_the_faster_prefill_attention(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
):
    from worker.model.llama import can_pack
    from worker.model.prefill_attention import blocked_is_faster

    faster, blocked_s, sdpa_s = blocked_is_faster(4, 2, 16, torch.float32, 512, repeats=2)
    assert blocked_s > 0 and sdpa_s > 0 and faster == (blocked_s < sdpa_s)
    # bf16 times the two as well, where oneDNN has bf16 kernels for the query blocks
    dtypes = ["float32", "bfloat16"] if can_pack(torch.bfloat16) else ["float32"]
    for dtype in dtypes:
        runner = make_runner(tiny_llama, dtype=dtype, block_size=16, num_blocks=64)
        caplog.clear()
        with caplog.at_level("INFO", logger="worker.model.runner"):
            assert runner.warm_up(600) == 600
        chosen = [r.getMessage() for r in caplog.records if "prefill attention" in r.getMessage()]
        assert len(chosen) == 1, dtype
        kept = "query blocks" if runner.blocked_attention else "SDPA"
        assert chosen[0].startswith(f"prefill attention: {kept}"), dtype


@pytest.mark.parametrize("name", MODELS)
def test_last_layer_queries_only_the_logits_rows(
    request: pytest.FixtureRequest,
    hf_model: HFLoader,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
):
    """Rows without logits skip the last layer's attention and MLP, not its K/V."""
    import worker.model.attention as attention

    path = model_dir(request, name)
    hf = hf_model(path)
    runner = make_runner(path, block_size=4, num_blocks=64)
    seqs = [prompt(runner.vocab_size, 40, seed=50), prompt(runner.vocab_size, 36, seed=51)]
    tables = [blocks(0, 40, 4), blocks(12, 36, 4)]
    step = [SeqChunk(seqs[0], 0, tables[0], True), SeqChunk(seqs[1][:30], 0, tables[1], False)]

    def plan(chunks: list[SeqChunk], **kwargs: bool) -> attention.StepPlan:
        return attention.build_plan(
            chunks, 4, runner.max_model_len, runner.device, runner.dtype, **kwargs
        )

    tail = plan(step).tail
    assert tail is not None and tail.rows.tolist() == [39]
    assert plan(step, tail=False).tail is None
    decodes = [SeqChunk([5], 39, tables[0], True)] * 40  # every row needs logits
    assert plan(decodes).tail is None
    out = runner.execute(step)
    assert out.shape == (1, runner.vocab_size)
    assert_close(out[0], hf_logits(hf, seqs[0])[-1], atol=ATOL, rtol=RTOL)
    # The chunk without logits stored its last-layer K/V: its continuation is exact.
    rest = runner.execute([SeqChunk(seqs[1][30:], 30, tables[1], True)])
    assert_close(rest[0], hf_logits(hf, seqs[1])[-1], atol=ATOL, rtol=RTOL)
    # A step in which no row needs logits returns none.
    none = runner.execute([SeqChunk(seqs[1], 0, blocks(30, 36, 4), False)])
    assert none.shape == (0, runner.vocab_size)
    # The same step with every row through the last layer gives the same logits.
    monkeypatch.setattr(attention, "TAIL_MIN_SKIPPED", 10**9)
    every = make_runner(path, block_size=4, num_blocks=64).execute(step)
    # As close as each is to HF: oneDNN sums a 1-row product and a 40-row one in different
    # orders (2.1e-5 apart on SmolLM2 on an Intel Xeon with AMX).
    assert_close(out, every, atol=ATOL, rtol=RTOL)


def test_the_prefill_attention_timing_takes_the_two_kernels_in_turns(
    monkeypatch: pytest.MonkeyPatch,
):
    """A moment of contention during the timing slows both kernels alike: they are timed
    in turns, each once untimed first, and each keeps its best time."""
    import worker.model.prefill_attention as pa

    calls: list[str] = []
    takes = {"blocked": 0.001, "sdpa": 0.02}

    def kernel(name: str, result: torch.Tensor):
        def run(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            # A busy moment (the third call of each) must not decide the choice.
            busy = 0.1 if calls.count(name) == 3 else 0.0
            time.sleep(takes[name] + busy)
            return result

        return run

    out = torch.zeros(1)
    monkeypatch.setattr(pa, "causal_attention", kernel("blocked", out))
    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", kernel("sdpa", out))
    faster, blocked_s, sdpa_s = pa.blocked_is_faster(4, 2, 16, torch.float32, 64, repeats=3)
    assert calls == ["blocked", "sdpa"] + ["blocked", "sdpa"] * 3
    assert faster and 0.001 <= blocked_s < 0.02 <= sdpa_s < 0.1
