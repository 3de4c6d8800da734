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
