"""A large fleet's router rows, kept between requests, equal rows built afresh.

``FleetColumns`` redoes only the rows whose inputs changed; a missed change
would route on a stale load. Random events of every kind that feeds a row —
the gateway's own sends and finishes, another replica's loads and finishes,
new records, blocks coming and going in the index, workers leaving and
cooling down — each followed by a request whose rows (and decision) must
equal ``router_rows`` over the same workers. The mirror, index, dispatcher
and replica sync are the real ones, fed through their own entry points
(no Redis needed for those).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, WorkerRecord
from gateway.routing.index import BlockIndex
from gateway.routing.index_share import IndexServer, RemoteIndex
from gateway.routing.load import router_rows
from gateway.routing.mirror import IndexMirror
from gateway.routing.replicas import ReplicaSync
from gateway.routing.router import SMALL_FLEET, Router, RouterConfig, RouteRequest
from gateway.text.prefix_tokens import Prompt
from gateway.upstream.base import Chunk
from loadtest.scale_dispatcher import chain_job, standalone_dispatcher
from openai_api.errors import APIError

WORKERS = 48  # past SMALL_FLEET: the matrix path


def _record(wid: str, rnd: random.Random, lens: tuple[int, ...], **fields: object) -> WorkerRecord:
    base = WorkerRecord(
        worker_id=wid,
        address="127.0.0.1:1",
        model="m",
        hash_spec=HashSpec(16, "m").describe(),
        block_size=16,
        epoch="e1",
        num_blocks=1000,
        max_model_len=rnd.choice(lens),
        running=rnd.randrange(4),
        waiting=rnd.randrange(3),
        queued_prefill_tokens=rnd.randrange(3) * 300,
        prefill_tokens_per_s=rnd.choice([0.0, 900.0, 1000.0]),
        updated_at=time.time() + rnd.random(),
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def test_kept_rows_equal_rows_built_afresh_after_any_events() -> None:
    assert WORKERS > SMALL_FLEET
    for seed in range(4):
        rnd = random.Random(seed)
        # Seeds 0 and 1: every worker fits the prompt (the healthy list is the
        # candidates); 2 and 3: some workers' contexts are too small for it.
        lens = (0, 4096) if seed < 2 else (0, 4096, 4096, 200)
        index = BlockIndex()
        mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
        d = standalone_dispatcher(mirror, index)
        sync = ReplicaSync(
            lambda: None,
            "routes",
            index,
            d.sessions,
            d.loads,
            speculative_ttl_s=2.0,
            known_worker=mirror.workers.__contains__,
        )
        d.replicas = sync
        workers = [f"w{i:02d}" for i in range(WORKERS)]
        for w in workers:
            mirror._discover(w, _record(w, rnd, lens).to_mapping())
        prompt = Prompt(list(range(300)))  # 18 blocks; fits every context but 200
        chain = prompt.block_hashes(HashSpec(16, "m"))
        now = 1000.0
        for _ in range(400):
            w = rnd.choice(workers)
            op = rnd.random()
            if op < 0.25:  # this gateway sends to w, or a stream on w ends
                load = d.loads.of(w)
                if rnd.random() < 0.6:
                    load.inflight += 1
                    load.pending += 1
                    load.pending_prefill_tokens += rnd.randrange(500)
                else:
                    load.inflight = max(0, load.inflight - 1)
                    load.pending = max(0, load.pending - 1)
                    load.pending_prefill_tokens = 0
                    load.finished += 1
            elif op < 0.45:  # another replica's loads (and finishes) arrive, or it goes quiet
                if rnd.random() < 0.15:
                    now += 5.0
                    sync.expire(now)
                    continue
                view = {x: [rnd.randrange(3), rnd.randrange(2), rnd.randrange(400)] for x in [w]}
                fields = {b"g": f"peer{rnd.randrange(2)}".encode(), b"d": json.dumps(view).encode()}
                if rnd.random() < 0.4:
                    fields[b"f"] = json.dumps({w: 1}).encode()
                sync.apply(fields, now)
            elif op < 0.6:  # a heartbeat with new numbers
                mirror._discover(w, _record(w, rnd, lens).to_mapping())
            elif op < 0.8:  # blocks stored or evicted
                part = chain[: rnd.randrange(len(chain) + 1)]
                if rnd.random() < 0.7:
                    index.add(w, part + [rnd.getrandbits(64) for _ in range(rnd.randrange(5))])
                else:
                    index.remove(w, part)
            elif op < 0.85 and len(mirror.workers) > SMALL_FLEET + 2:  # w leaves
                if w in mirror.workers:
                    mirror.drop_worker(w)
                    d.forget(w)
            elif op < 0.9:  # w fails a call: it cools down (briefly)
                d._down_until[w] = time.monotonic() + rnd.choice([0.0, 30.0])
                d._cooldowns += 1
            elif w not in mirror.workers:  # w comes back
                mirror._discover(w, _record(w, rnd, lens).to_mapping())

            job = replace(chain_job([]), prompt=prompt)
            cands = d.hash(job, d.candidates())
            cached = d.look_up(cands)
            ids, rows, matrix = d._router_view(cands, cached)
            peers = sync.peer_loads()
            want_ids, want = router_rows(cands.entries, d.loads, cached, index.block_count, peers)
            if len(cands.entries) <= SMALL_FLEET:
                assert (ids, rows, matrix) == (want_ids, want, None)
                continue
            assert matrix is not None and ids == want_ids
            np.testing.assert_array_equal(matrix, np.array(want, dtype=np.float64))
            # ... and the router decides the same on either.
            request = RouteRequest(prompt_tokens=300, block_size=16, session_worker=w)
            a, b = Router(RouterConfig()), Router(RouterConfig())
            assert a.choose_columns(request, ids, matrix) == b.choose_rows(request, ids, want)


def test_rows_of_a_list_from_before_the_fleet_changed_are_built_afresh() -> None:
    rnd = random.Random(7)
    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    d = standalone_dispatcher(mirror, index)
    for i in range(WORKERS):
        w = f"w{i:02d}"
        mirror._discover(w, _record(w, rnd, (4096,)).to_mapping())
    job = replace(chain_job([]), prompt=Prompt(list(range(100))))
    cands = d.hash(job, d.candidates())
    mirror.drop_worker("w03")  # while the request waited for its look-up
    ids, rows, matrix = d._router_view(cands, {"w03": 2})
    assert matrix is None and "w03" in ids  # the request's own candidates, as they were
    assert rows == router_rows(cands.entries, d.loads, {"w03": 2}, index.block_count, {})[1]


class _Call:
    """One upstream call that answers at once (a first token, or nothing: a failure),
    after another request routed meanwhile (``meanwhile``)."""

    def __init__(self, fails: bool, meanwhile: Callable[[], None]) -> None:
        self.fails, self.meanwhile = fails, meanwhile

    async def read(self) -> Chunk | None:
        self.meanwhile()
        return None if self.fails else Chunk([7])

    async def read_within(self, limit_s: float) -> Chunk | None:
        return await self.read()

    def cancel(self) -> None:
        pass


class _Upstream:
    """Calls to the workers named in ``failing`` end before a token; the others answer."""

    def __init__(self) -> None:
        self.failing: set[str] = set()
        self.meanwhile: Callable[[], None] = lambda: None

    def start(self, worker_id: str, *args: object, **kwargs: object) -> _Call:
        return _Call(worker_id in self.failing, self.meanwhile)

    def connect(self, *args: object, **kwargs: object) -> None:
        pass

    def forget(self, worker_id: str) -> None:
        pass


async def test_the_dispatchers_own_sends_retries_and_finishes_reach_the_kept_rows() -> None:
    # The dispatcher's own bookkeeping (a send, a failed first attempt, a stream's end)
    # through ``open`` and ``Stream.close``: the rows after each equal rows built afresh.
    rnd = random.Random(3)
    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    upstream = _Upstream()
    d = standalone_dispatcher(mirror, index, upstreams={"grpc": upstream})
    for i in range(WORKERS):
        w = f"w{i:02d}"
        mirror._discover(w, _record(w, rnd, (4096,)).to_mapping())
    job = replace(chain_job([]), prompt=Prompt(list(range(100))))

    def rows_equal_fresh() -> None:
        cands = d.hash(job, d.candidates())
        cached = d.look_up(cands)
        ids, _, matrix = d._router_view(cands, cached)
        want_ids, want = router_rows(cands.entries, d.loads, cached, index.block_count, {})
        assert matrix is not None and ids == want_ids
        np.testing.assert_array_equal(matrix, np.array(want, dtype=np.float64))

    upstream.meanwhile = rows_equal_fresh
    streams = []
    for n in range(30):
        rows_equal_fresh()
        cands = d.hash(job, d.candidates())
        cached = d.look_up(cands)
        decision = d.choose(job, cands, cached)
        upstream.failing = {decision.worker_id} if n % 3 == 0 else set()
        streams.append(await d.open(job, cands, cached, decision))
        rows_equal_fresh()
        if n % 2:
            streams.pop(0).close(cached_tokens=None)
    assert {s.reason for s in streams} >= {"retry"}
    for s in streams:
        s.close(cached_tokens=None)
    rows_equal_fresh()


async def test_a_front_process_keeps_rows_over_its_owners_index(tmp_path: Path) -> None:
    # A front of a multi-process gateway looks blocks up in its owner's index over
    # the real socket and reads the owner's block counts: its kept rows equal rows
    # built afresh from the same counts.
    rnd = random.Random(11)
    owner_index = BlockIndex()
    server = IndexServer(str(tmp_path / "index.sock"), owner_index)
    await server.start(lambda: asyncio.sleep(0, b""))
    remote = RemoteIndex(server.path)
    try:
        await remote.connect(lambda: asyncio.sleep(0, b""))
        mirror = IndexMirror("redis://unused", RedisLayout("t"), BlockIndex(), blocks=False)
        d = standalone_dispatcher(mirror, remote)  # type: ignore[arg-type]
        job = replace(chain_job([]), prompt=Prompt(list(range(300))))
        chain = job.prompt.block_hashes(HashSpec(16, "m"))
        for i in range(WORKERS):
            w = f"w{i:02d}"
            mirror._discover(w, _record(w, rnd, (4096,)).to_mapping())
            owner_index.add(w, [*chain[: rnd.randrange(len(chain))], rnd.getrandbits(64)])
        await remote.refresh_counts()
        for _ in range(3):
            cands = d.hash(job, d.candidates())
            cached = await d.alook_up(cands)
            assert cached and max(cached.values()) > 1  # the owner's holders came back
            ids, _, matrix = d._router_view(cands, cached)
            want_ids, want = router_rows(cands.entries, d.loads, cached, remote.block_count, {})
            assert matrix is not None and ids == want_ids
            np.testing.assert_array_equal(matrix, np.array(want, dtype=np.float64))
            decision = d.choose(job, cands, cached)
            d.loads.of(decision.worker_id).inflight += 1
    finally:
        await server.close()


def test_a_large_fleet_answers_429_when_every_queue_is_full() -> None:
    rnd = random.Random(5)
    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    d = standalone_dispatcher(mirror, index, max_queue_per_worker=2)
    workers = [f"w{i:02d}" for i in range(WORKERS)]
    for w in workers:
        mirror._discover(w, _record(w, rnd, (4096,), waiting=0).to_mapping())
    job = replace(chain_job([]), prompt=Prompt(list(range(100))))
    for w in workers[1:]:
        d.loads.of(w).pending = 2  # sent, no first token yet
    cands = d.hash(job, d.candidates())
    assert d.choose(job, cands, d.look_up(cands)).worker_id  # w00 has room: no 429
    d.loads.of("w00").pending = 2
    with pytest.raises(APIError) as err:
        d.choose(job, cands, d.look_up(cands))
    assert err.value.status == 429


def test_a_small_fleet_keeps_no_marks() -> None:
    # Routed without the matrix, the marks would only pile up: worker names change
    # with every restart of a worker pod.
    rnd = random.Random(9)
    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("t"), index)
    d = standalone_dispatcher(mirror, index)
    for i in range(4):
        mirror._discover(f"w{i}", _record(f"w{i}", rnd, (4096,)).to_mapping())
    job = replace(chain_job([]), prompt=Prompt(list(range(100))))
    d.loads.of("gone-long-ago").inflight += 1
    cands = d.hash(job, d.candidates())
    d.choose(job, cands, d.look_up(cands))
    assert d.loads.touched == set()
