"""``Dispatcher.healthy`` is reused between requests and redone when the mirror changes.

A request asks for the healthy workers up to three times; at 1,000 workers each
pass over the records cost ~0.3 ms, so the list is kept until a worker comes or
goes, a record changes or a cooldown starts or ends. The mirror here is the
real ``IndexMirror`` fed through its own registry code (no Redis needed for that).
"""

from __future__ import annotations

import time
from dataclasses import replace

from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, WorkerRecord
from gateway.routing.dispatch import _deepest_block
from gateway.routing.index import BlockIndex
from gateway.routing.mirror import IndexMirror
from loadtest.scale_dispatcher import standalone_dispatcher


def _record(wid: str, **fields: object) -> WorkerRecord:
    spec = HashSpec(16, "m")
    base = WorkerRecord(
        worker_id=wid,
        address="127.0.0.1:1",
        model="m",
        hash_spec=spec.describe(),
        block_size=16,
        epoch="e1",
        prefill_tokens_per_s=1000.0,
        updated_at=time.time(),
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def test_healthy_is_reused_until_the_mirror_or_a_cooldown_changes() -> None:
    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    d = standalone_dispatcher(mirror, index)
    mirror._discover("a", _record("a").to_mapping())
    mirror._discover("b", _record("b").to_mapping())

    first = d.healthy()
    assert [e.record.worker_id for e in first] == ["a", "b"]
    assert d.healthy() is first  # nothing changed: the same list
    assert d.max_model_len(4096) == 4096  # no worker says: the gateway's own

    mirror._discover("b", _record("b", max_model_len=8192).to_mapping())
    assert d.max_model_len(4096) == 8192  # b's new record, seen at once

    # a's next heartbeat says its engine stalled: the list is redone without it
    mirror._discover("a", _record("a", engine_step_age_s=60.0).to_mapping())
    assert [e.record.worker_id for e in d.healthy()] == ["b"]

    # b leaves: every remaining worker is stalled, so they are kept
    mirror.drop_worker("b")
    assert [e.record.worker_id for e in d.healthy()] == ["a"]

    # a cooldown hides a worker until it ends, with no other change
    mirror._discover("a", _record("a").to_mapping())
    d._down_until["a"] = time.monotonic() + 0.2
    d._cooldowns += 1
    assert d.healthy() == []
    time.sleep(0.25)
    assert [e.record.worker_id for e in d.healthy()] == ["a"]


def test_hash_groups_workers_by_spec_and_context_and_keeps_their_order() -> None:
    from gateway.edge.auth import Tenant
    from gateway.text.prefix_tokens import Prompt
    from loadtest.scale_dispatcher import chain_job

    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    d = standalone_dispatcher(mirror, index)
    other = HashSpec(32, "m").describe()
    fleet = {
        "a": {},
        "b": {"max_model_len": 64},  # too small for the job below
        "c": {"hash_spec": other, "block_size": 32},
        "d": {},
        "e": {"hash_spec": other, "block_size": 32, "max_model_len": 100_000},
    }
    for wid, fields in fleet.items():
        mirror._discover(wid, _record(wid, **fields).to_mapping())
    job = replace(chain_job([]), prompt=Prompt(list(range(100))))  # a 100-token prompt
    for tenant in (Tenant(), Tenant(name="t", cache_salt="s")):
        job = replace(job, tenant=tenant)
        cands = d.hash(job, d.candidates())
        assert [e.record.worker_id for e in cands.entries] == ["a", "c", "d", "e"]
        for e in cands.entries:
            spec = e.spec
            assert spec is not None
            assert cands.chains[e.record.worker_id] == job.prompt.block_hashes(
                spec.with_salt(tenant.cache_salt)
            )
        assert cands.chains["a"] is cands.chains["d"] and cands.chains["c"] is cands.chains["e"]
        assert len(cands.chains["a"]) == 6 and len(cands.chains["c"]) == 3
        deepest = _deepest_block(cands, {"a": 1, "c": 2, "d": 1})
        assert deepest == cands.chains["c"][1]
        # Per worker, the same rows as one at a time.
        ids, rows = d._rows(cands.entries, {"a": 3})
        assert ids == ["a", "c", "d", "e"]
        assert rows == [d._row(e, 3 if e.record.worker_id == "a" else 0) for e in cands.entries]


def test_a_fleet_of_one_spec_shares_one_chain_without_a_dict_per_request() -> None:
    from gateway.text.prefix_tokens import Prompt
    from loadtest.scale_dispatcher import chain_job

    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    d = standalone_dispatcher(mirror, index)
    for wid in ("a", "b", "c"):
        mirror._discover(wid, _record(wid).to_mapping())
    job = replace(chain_job([]), prompt=Prompt(list(range(100))))
    cands = d.hash(job, d.candidates())
    want = job.prompt.block_hashes(HashSpec(16, "m"))
    assert dict(cands.chains) == {"a": want, "b": want, "c": want}
    assert cands.chains.keys() == {"a", "b", "c"} and cands.distinct == [want]
    assert cands.chains.get("z") is None and "z" not in cands.chains
    # A look-up's holders are all candidates: they are taken as they came.
    index.add("b", want[:2])
    assert d.look_up(cands) == {"b": 2}
    # The longest cached prefix's last block (what prefix demand counts).
    assert _deepest_block(cands, {"a": 1, "b": 2}) == want[1]
