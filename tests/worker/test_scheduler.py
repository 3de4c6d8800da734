"""Scheduler and Sequence on a tiny pool (block_size 4): exact chunks, block ids, preemptions."""

from __future__ import annotations

import pytest

from contract.events import BlockStored
from contract.hashing import HashSpec, block_hashes
from worker.engine.batch import Batch
from worker.engine.block_pool import BlockPool
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4
SPEC = HashSpec(block_size=BS, model="test")
EOS = 0


def make(num_blocks: int = 12, **config: int) -> Scheduler:
    cfg = SchedulerConfig(**{"max_model_len": 64, "eos_token_ids": (EOS,), **config})
    return Scheduler(cfg, BlockPool(num_blocks, BS))


def seq(request_id: str, tokens: list[int], max_tokens: int = 8, **params: object) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params), SPEC)


def step(sched: Scheduler, token: int = 50) -> Batch:
    """One step where every sequence that needs a token gets ``token``."""
    batch = sched.schedule()
    sched.postprocess(batch, [token] * len(batch.sampled_seqs()), now=0.0)
    return batch


def assert_all_free(sched: Scheduler) -> None:
    assert [b.ref_cnt for b in sched.pool.blocks] == [0] * sched.pool.num_blocks
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_chunked_prefill_then_decode_with_exact_chunks() -> None:
    sched = make(max_batch_tokens=6)
    a = seq("a", list(range(1, 11)), max_tokens=2)
    sched.add(a)
    b1 = sched.schedule()
    assert [(c.token_ids, c.start_pos, c.block_table, c.need_logits) for c in b1.chunks] == [
        ([1, 2, 3, 4, 5, 6], 0, [0, 1], False)
    ]
    assert a.block_table == [0, 1, 2]  # every prompt block is reserved at admission
    sched.postprocess(b1, [], now=0.0)
    assert sched.pool.take_events() == [BlockStored((block_hashes(a.token_ids, SPEC)[0],), None)]
    b2 = step(sched, token=60)
    assert [(c.token_ids, c.start_pos, c.block_table, c.need_logits) for c in b2.chunks] == [
        ([7, 8, 9, 10], 6, [0, 1, 2], True)
    ]
    assert a.token_ids[-1] == 60 and a.is_decoding
    b3 = step(sched, token=61)
    assert [(c.token_ids, c.start_pos, c.block_table) for c in b3.chunks] == [([60], 10, [0, 1, 2])]
    assert (b3.num_decode_tokens, b3.num_prefill_tokens) == (1, 0)
    assert a.finish_reason == "length" and a.token_ids[-2:] == [60, 61]
    assert_all_free(sched)


def test_decodes_come_first_and_prefill_fills_the_rest_of_the_budget() -> None:
    sched = make(max_batch_tokens=5)
    sched.add(seq("a", [1, 2, 3]))
    step(sched)
    sched.add(seq("b", list(range(1, 10))))
    batch = step(sched)
    assert [s.request_id for s in batch.seqs] == ["a", "b"]
    assert [len(c.token_ids) for c in batch.chunks] == [1, 4]
    assert (batch.num_decode_tokens, batch.num_prefill_tokens) == (1, 4)


def test_prefix_hit_shares_blocks_and_skips_cached_tokens() -> None:
    sched = make()
    a = seq("a", list(range(1, 10)), max_tokens=1)  # 2 full blocks + 1 token
    sched.add(a)
    step(sched)
    assert a.is_finished
    b = seq("b", [*range(1, 9), 77, 78], max_tokens=1)
    sched.add(b)
    batch = sched.schedule()
    assert b.block_table[:2] == [0, 1]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert [(c.token_ids, c.start_pos) for c in batch.chunks] == [([77, 78], 8)]


def test_fully_cached_prompt_recomputes_only_its_last_token() -> None:
    sched = make()
    prompt = list(range(1, 9))  # exactly 2 blocks
    a = seq("a", prompt, max_tokens=1)
    sched.add(a)
    step(sched)
    c = seq("c", prompt, max_tokens=1)
    sched.add(c)
    batch = sched.schedule()
    assert c.num_cached_tokens == 8
    assert [
        (ch.token_ids, ch.start_pos, ch.block_table, ch.need_logits) for ch in batch.chunks
    ] == [([8], 7, [0, 1], True)]
    sched.postprocess(batch, [5], now=0.0)
    assert_all_free(sched)


def test_generated_tokens_complete_and_cache_blocks() -> None:
    sched = make()
    a = seq("a", [1, 2, 3], max_tokens=3)
    sched.add(a)
    step(sched, token=10)  # prompt computed, 10 sampled (not in KV yet)
    assert sched.pool.take_events() == []
    step(sched, token=11)  # 10 computed: block 0 = [1, 2, 3, 10] is full
    assert sched.pool.take_events() == [BlockStored(tuple(block_hashes([1, 2, 3, 10], SPEC)))]
    step(sched, token=12)
    assert a.token_ids == [1, 2, 3, 10, 11, 12] and a.finish_reason == "length"
    assert sched.pool.resident_hashes() == set(block_hashes([1, 2, 3, 10], SPEC))


def test_decode_out_of_blocks_preempts_the_newest_then_resumes_from_its_cache() -> None:
    sched = make(num_blocks=4)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=3)
    b = seq("b", [11, 12, 13, 14, 15, 16, 17], max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    # b finishes its prompt chunk but stays (it will be preempted before its own decode step).
    sched.postprocess(batch, [8, 18], now=0.0)
    assert b.is_finished  # max_tokens=1
    sched.add(b2 := seq("b2", [11, 12, 13, 14, 21, 22, 23], max_tokens=2))
    batch = step(sched, token=9)  # a decodes token 8 in place; b2 hits block 2 and takes 3
    assert b2.block_table == [2, 3] and b2.num_cached_tokens == 4
    assert [s.request_id for s in batch.seqs] == ["a", "b2"]
    # a's next token (position 8) needs a third block: none free, so b2 (newest) is preempted.
    batch = sched.schedule()
    assert sched.preemptions_total == 1
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert a.block_table == [0, 1, 3]  # b2 freed tail-first: its uncached block 3 went first
    assert b2.status is SequenceStatus.WAITING and sched.waiting[0] is b2
    assert b2.block_table == [] and b2.num_computed_tokens == 0
    assert sched.pool.blocks[2].ref_cnt == 0 and sched.pool.blocks[2].block_hash is not None
    sched.postprocess(batch, [10], now=0.0)
    assert a.is_finished
    # b2 comes back with its cached block 2 and recomputes its prompt and sampled token.
    batch = sched.schedule()
    assert b2.block_table[0] == 2 and b2.num_computed_tokens == 4
    assert [(c.token_ids, c.start_pos) for c in batch.chunks] == [([21, 22, 23, 9], 4)]
    assert b2.num_cached_tokens == 4  # usage keeps the first admission's hit
    sched.postprocess(batch, [30], now=0.0)
    assert b2.token_ids[-2:] == [9, 30] and b2.finish_reason == "length"
    assert_all_free(sched)


def test_preempting_itself_when_it_is_the_newest() -> None:
    sched = make(num_blocks=2)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    sched.add(a)
    step(sched)
    step(sched)  # token at position 7 fills block 1
    batch = sched.schedule()  # position 8 needs a third block: none exists
    assert not batch and sched.preemptions_total == 1 and sched.waiting[0] is a
    assert_all_free(sched)


def test_admission_waits_for_blocks_in_fcfs_order_and_max_num_seqs() -> None:
    sched = make(num_blocks=4, max_num_seqs=2)
    sched.add(a := seq("a", list(range(1, 10)), max_tokens=1))  # 3 blocks
    sched.add(b := seq("b", list(range(1, 6)), max_tokens=1))  # 2 blocks: does not fit yet
    sched.add(c := seq("c", [1], max_tokens=1))  # would fit, but waits behind b
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"]
    sched.postprocess(batch, [5], now=0.0)
    assert a.is_finished
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["b", "c"]
    assert b.num_cached_tokens == 4  # b's first block is a's block 0
    sched.add(seq("d", [1], max_tokens=1))
    assert len(sched.running) == 2
    sched.postprocess(batch, [5, 5], now=0.0)
    assert c.is_finished and step(sched).seqs[0].request_id == "d"
    assert_all_free(sched)


def test_abort_frees_blocks_of_running_and_waiting_sequences() -> None:
    sched = make(num_blocks=4, max_batch_tokens=4)
    sched.add(seq("a", list(range(1, 10))))
    sched.add(seq("b", [1, 2]))
    step(sched)
    assert sched.pool.num_used_blocks == 3
    aborted = sched.abort("a")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert sched.abort("b") is not None
    assert sched.abort("nope") is None
    assert not sched.has_work()
    assert_all_free(sched)


def test_a_sequence_that_can_never_fit_is_dropped() -> None:
    sched = make(num_blocks=3)
    sched.pool.pin(sched.pool.allocate(1) or [])
    big = seq("big", list(range(1, 11)), max_tokens=1)  # 3 blocks, only 2 unpinned
    sched.add(big)
    assert not sched.schedule()
    assert sched.take_dropped() == [big] and big.finish_reason == "abort"
    assert not sched.has_work()


def test_queued_prefill_tokens_counts_waiting_and_unfinished_prompts() -> None:
    sched = make(max_batch_tokens=4, max_num_seqs=1)
    sched.add(seq("a", list(range(1, 11))))
    sched.add(seq("b", [1, 2, 3]))
    assert sched.queued_prefill_tokens == 13
    step(sched)
    assert sched.queued_prefill_tokens == 9


def test_hash_collision_is_confirmed_against_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    def colliding(existing: list[int], token_ids: list[int], spec: HashSpec) -> list[int]:
        # Every chain hashes to 1, 2, 3...: different prompts collide.
        return list(range(len(existing) + 1, len(token_ids) // spec.block_size + 1))

    monkeypatch.setattr("worker.engine.sequence.extend_block_hashes", colliding)
    sched = make()
    sched.add(seq("a", [1, 2, 3, 4, 5], max_tokens=1))
    step(sched)
    assert sched.pool.take_events() == [BlockStored((1,), None)]
    b = seq("b", [9, 9, 9, 9, 5], max_tokens=1)
    sched.add(b)
    batch = sched.schedule()
    assert b.num_cached_tokens == 0 and b.block_table[0] != 0
    assert batch.chunks[0].start_pos == 0
    sched.postprocess(batch, [5], now=0.0)
    assert sched.pool.take_events() == []  # hash 1 is taken: b's block stays unregistered
    assert sched.pool.blocks[0].token_ids == (1, 2, 3, 4)


@pytest.mark.parametrize(
    ("tokens", "params", "reason"),
    [
        ([1, EOS], {}, "stop"),
        ([1, EOS], {"ignore_eos": True}, None),
        ([1, 7], {"stop_token_ids": (7,)}, "stop"),
        ([1, 7, 8], {"max_tokens": 2}, "length"),
        ([1, 7], {"max_tokens": 5}, None),
    ],
)
def test_stop_reasons(tokens: list[int], params: dict[str, object], reason: str | None) -> None:
    s = seq("s", tokens[:1], **{"max_tokens": 5, **params})  # type: ignore[arg-type]
    for t in tokens[1:]:
        s.append_token(t, now=0.0)
    assert s.stop_reason((EOS,), max_model_len=64) == reason
    assert s.stop_reason((EOS,), max_model_len=len(tokens)) == (reason or "length")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 1.5, "max_tokens"),
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("seed", "x", "seed"),
        ("stop_token_ids", (100,), "stop_token_ids"),
    ],
)
def test_sampling_params_validation(field: str, value: object, match: str) -> None:
    SamplingParams().validate(vocab_size=100)
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value}).validate(vocab_size=100)  # type: ignore[arg-type]


def test_scheduler_config_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--max-batch-tokens"):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        SchedulerConfig(max_num_seqs=0)
