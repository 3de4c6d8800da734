"""Gateway replicas act as one: real Redis, three real gateway apps, fake gRPC workers.

The workers publish no cache events here, so what keeps a conversation
together across replicas is only what the replicas share through
``{ns}:routes``: sessions and speculative entries; and what one replica knows
of another's in-flight requests is only their loads entries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest

from gateway.routing import replicas
from gateway.routing.replicas import PEER_TTL_S
from tests.gateway.conftest import Harness, MakeGateway
from tests.gateway.helpers import eventually, namespace

HELLO = [{"role": "user", "content": "Say hello"}]


async def _replicas(make_gateway: MakeGateway, n: int, **overrides: Any) -> list[Harness]:
    ns = namespace()
    return [await make_gateway(redis_namespace=ns, **overrides) for _ in range(n)]


async def _fleet(gateways: list[Harness], workers: int, **fake: Any) -> None:
    first = gateways[0]
    for i in range(workers):
        await first.add_worker(f"w{i}", **fake)
    for g in gateways[1:]:
        await eventually(partial(_has_workers, g, workers), what="fleet")


def _has_workers(g: Harness, n: int) -> bool:
    return len(g.state.mirror.workers) == n


async def _turns(gateways: list[Harness], conversations: int, turns: int) -> dict[str, list[str]]:
    """Each conversation's turns round-robin over the replicas; the worker of every turn."""
    seen: dict[str, list[str]] = {f"c{c}": [] for c in range(conversations)}
    for t in range(turns):
        for c, conv in enumerate(seen):
            g = gateways[(c + t) % len(gateways)]
            # Its own system prompt, so conversations share no prefix: nothing but
            # what the replicas share ties a turn to the worker of the one before.
            system = {"role": "system", "content": f"{conv}: a helpful assistant"}
            history = [{"role": "user", "content": f"{conv} turn {k} " * 6} for k in range(t + 1)]
            resp = await g.chat([system, *history], user=conv)
            assert resp.status == 200, await resp.text()
            seen[conv].append(resp.headers["x-kvroute-worker"])
        await asyncio.sleep(0.15)  # think time: the turn's entry reaches the other replicas
    return seen


async def test_a_conversation_keeps_its_worker_across_replicas(
    make_gateway: MakeGateway,
) -> None:
    gateways = await _replicas(make_gateway, 3)
    await _fleet(gateways, 4)
    seen = await _turns(gateways, conversations=8, turns=4)
    moved = {conv: ws for conv, ws in seen.items() if len(set(ws)) > 1}
    assert not moved, f"turns changed worker across replicas: {moved}"
    assert len({ws[0] for ws in seen.values()}) >= 3, f"conversations did not spread: {seen}"
    assert all(g.state.dispatcher.replicas.applied > 0 for g in gateways)  # type: ignore[union-attr]


async def test_each_replica_breaks_cold_ties_in_its_own_share_of_the_fleet(
    make_gateway: MakeGateway,
) -> None:
    # Replicas routing a burst at the same moment cannot hear each other in time:
    # each takes its ties to its own share of the workers (every third by id, from
    # its rank), so simultaneous cold requests do not land on one worker.
    gateways = await _replicas(make_gateway, 3)
    await _fleet(gateways, 6)
    syncs = [g.state.dispatcher.replicas for g in gateways]
    assert all(s is not None for s in syncs)
    await eventually(lambda: all(s.rank()[1] == 3 for s in syncs), what="three replicas")  # type: ignore[union-attr]
    ranks = [s.rank()[0] for s in syncs]  # type: ignore[union-attr]
    assert sorted(ranks) == [0, 1, 2]
    for g, rank in zip(gateways, ranks, strict=True):
        for i in range(2):
            system = {"role": "system", "content": f"replica {rank}, cold request {i}"}
            resp = await g.chat([system, *HELLO], user=f"r{rank}-{i}")
            assert resp.status == 200, await resp.text()
            assert int(resp.headers["x-kvroute-worker"][1:]) % 3 == rank


async def test_a_peer_holds_a_queued_chain_until_its_first_token(
    make_gateway: MakeGateway,
) -> None:
    # Grace 0.2 s, first token after 0.8 s: a sibling at the other replica 0.5 s later
    # still goes where the first went; once it is served, both forget the chain.
    a, b = await _replicas(make_gateway, 2, speculative_ttl_s=0.2)
    await _fleet([a, b], 3, reply="slow answer", delay_s=0.8)
    messages = [{"role": "user", "content": "a document queued at one replica " * 20}]
    first = asyncio.create_task(a.chat(messages))
    await asyncio.sleep(0.5)
    second = await b.chat(messages)
    one = await first
    assert one.status == second.status == 200
    assert second.headers["x-kvroute-worker"] == one.headers["x-kvroute-worker"]
    chain = b.chat_hashes(messages)
    await eventually(lambda: b.state.index.longest_prefix(chain, time.monotonic()) == {})


async def test_peers_are_sent_only_the_blocks_a_worker_lacks(make_gateway: MakeGateway) -> None:
    # w0 really holds half the chain (both replicas mirror it from Redis): the routing
    # replica claims the other half, and that half is all its peer hears of.
    a, b = await _replicas(make_gateway, 2, speculative_ttl_s=30.0)
    await _fleet([a, b], 1, reply="slow answer", delay_s=0.8)
    messages = [{"role": "user", "content": "a document half cached already " * 20}]
    chain = a.chat_hashes(messages)
    half = len(chain) // 2
    _, reg = a.workers["w0"]
    await reg.store(chain[:half])
    for g in (a, b):
        await eventually(lambda g=g: g.state.index.block_count("w0") == half, what="stored")
    await eventually(lambda: b.state.dispatcher.replicas.rank()[1] == 2, what="peers")  # type: ignore[union-attr]
    first = asyncio.create_task(a.chat(messages))
    await eventually(lambda: b.state.index.speculative_count() > 0, what="peer's claim")
    assert b.state.index.speculative_count() == len(chain) - half
    assert b.state.index.longest_prefix(chain, time.monotonic()) == {"w0": len(chain)}
    assert (await first).status == 200


async def test_a_prefix_wanted_at_one_replica_counts_at_the_others(
    make_gateway: MakeGateway,
) -> None:
    a, b = await _replicas(make_gateway, 2)
    await _fleet([a, b], 1)
    messages = [{"role": "user", "content": "a document every replica sees " * 20}]
    for _ in range(3):  # the first finds nothing cached; the next two the speculated chain
        assert (await a.chat(messages)).status == 200
    chain = b.chat_hashes(messages)
    demand = b.state.dispatcher.prefix_demand
    # One entry counts at most 1 (it decays over 30 s): above 1.5, both were applied.
    await eventually(
        lambda: demand.wanted(chain[-1], time.monotonic()) > 1.5, what="both peer entries"
    )
    assert len(demand) == 1 and demand.wanted(chain[-1], time.monotonic()) <= 2.0


async def test_without_sync_the_replicas_do_not_share_sessions(make_gateway: MakeGateway) -> None:
    gateways = await _replicas(make_gateway, 3, replica_sync=False)
    await _fleet(gateways, 4)
    seen = await _turns(gateways, conversations=8, turns=1)  # also waits as sync would
    # Each replica knows the sessions it served and no other (with sync each knows all
    # eight). Whether a later turn through another replica then moves depends on that
    # replica's own ties and loads, which differ run to run: what sharing removes.
    for i, g in enumerate(gateways):
        served = [conv for c, conv in enumerate(seen) if c % len(gateways) == i]
        assert len(g.state.dispatcher.sessions) == len(served), (i, served)
    assert all(g.state.dispatcher.replicas is None for g in gateways)


async def test_in_flight_load_is_seen_by_the_other_replicas_and_ages_out(
    make_gateway: MakeGateway,
) -> None:
    a, b = await _replicas(make_gateway, 2)
    await _fleet([a, b], 1, reply="one two three four five six", delay_s=0.4)
    entry = b.state.mirror.workers["w0"]
    assert b.state.dispatcher.state(entry, 0).inflight == 0
    request = asyncio.create_task(a.chat([{"role": "user", "content": "slow"}]))
    await eventually(lambda: b.state.dispatcher.state(entry, 0).pending == 1, what="peer pending")
    await eventually(
        lambda: (
            b.state.dispatcher.state(entry, 0).inflight == 1
            and b.state.dispatcher.state(entry, 0).pending == 0
        ),
        what="peer in flight, first token out",
    )
    resp = await request
    assert resp.status == 200
    await eventually(lambda: b.state.dispatcher.state(entry, 0).inflight == 0, what="done")

    # A replica that dies with requests in flight stops counting within PEER_TTL_S.
    hung = asyncio.create_task(a.chat([{"role": "user", "content": "slow again"}]))
    await eventually(lambda: b.state.dispatcher.state(entry, 0).inflight == 1, what="in flight")
    replicas = a.state.dispatcher.replicas
    assert replicas is not None
    for task in replicas.tasks:  # a crash: no last word to the others
        task.cancel()
    started = time.monotonic()
    await eventually(
        lambda: b.state.dispatcher.state(entry, 0).inflight == 0,
        what="dead peer aged out",
        timeout=PEER_TTL_S + 3,
    )
    assert time.monotonic() - started >= PEER_TTL_S - 1.5
    hung.cancel()


async def test_finishes_at_one_replica_correct_the_heartbeat_at_the_others(
    make_gateway: MakeGateway,
) -> None:
    a, b = await _replicas(make_gateway, 2)
    await _fleet([a, b], 1)
    _, reg = a.workers["w0"]
    # A heartbeat that still counts requests about to finish: 2 running, 1 waiting.
    await reg.register(running=2, waiting=1)

    def seen_by(g: Harness) -> tuple[int, int]:
        view = g.state.dispatcher.state(g.state.mirror.workers["w0"], 0)
        return view.running, view.waiting

    for g in (a, b):
        await eventually(lambda g=g: seen_by(g) == (2, 1), what="the heartbeat")
    sync = a.state.dispatcher.replicas
    assert sync is not None
    await eventually(lambda: not sync.alone(time.monotonic()), what="the peer found")
    for i in range(2):
        assert (await a.chat(HELLO, user=f"u{i}")).status == 200
    # Two finishes since the heartbeat: the waiting request took a freed slot, then one
    # of the running ones is gone too. b routed none of them and sees it all the same.
    assert seen_by(a) == (1, 0)
    await eventually(lambda: seen_by(b) == (1, 0), what="a's finishes at b")
    # The next heartbeat counts them itself: nothing is taken off twice.
    await reg.register(running=1, waiting=0)
    await eventually(lambda: seen_by(b) == (1, 0) and seen_by(a) == (1, 0), what="new heartbeat")
    await reg.register(running=3, waiting=0)
    await eventually(lambda: seen_by(b) == (3, 0), what="a later heartbeat, uncorrected")


async def _entry_kinds(g: Harness) -> list[str]:
    """The kinds of entry on the routes stream, oldest first: loads, route or settle."""
    sync = g.state.dispatcher.replicas
    assert sync is not None
    kinds = []
    for _, batch in await g.redis.xrange(sync.stream_key):
        for fields in replicas.unbatched(batch):
            kinds.append("loads" if b"l" in fields else "route" if b"s" in fields else "settle")
    return kinds


async def test_a_lone_replica_writes_only_its_keepalive(
    make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replicas, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(replicas, "PEER_TTL_S", 0.6)
    (a,) = await _replicas(make_gateway, 1)
    await _fleet([a], 2)
    sync = a.state.dispatcher.replicas
    assert sync is not None
    await eventually(lambda: sync.alone(time.monotonic()), what="alone")
    before = len(await _entry_kinds(a))
    for i in range(4):
        assert (await a.chat(HELLO, user=f"u{i}")).status == 200
    await asyncio.sleep(0.3)
    assert set((await _entry_kinds(a))[before:]) == {"loads"}  # keepalives, nothing per request
    # A second replica announces itself, the first answers, and both share again.
    b = await make_gateway(redis_namespace=a.state.config.redis_namespace)
    await eventually(partial(_has_workers, b, 2), what="fleet")
    await eventually(lambda: not sync.alone(time.monotonic()), what="the peer found")
    before = len(await _entry_kinds(a))
    first = await a.chat(HELLO, user="later")
    assert first.status == 200
    b_sync = b.state.dispatcher.replicas
    assert b_sync is not None
    await eventually(lambda: b_sync.applied >= 3, what="loads, route and settle applied at b")
    assert {"route", "settle"} <= set((await _entry_kinds(a))[before:])
    second = await b.chat([*HELLO, {"role": "assistant", "content": "hi"}], user="later")
    assert second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]


async def test_a_dead_redis_only_loses_the_sharing(caplog: pytest.LogCaptureFixture) -> None:
    import redis.asyncio as aioredis

    from tests.support import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    sync = _lone_sync(
        client_factory=lambda: aioredis.Redis.from_url(dead, socket_connect_timeout=0.2)
    )
    tasks = sync.start()
    try:
        for _ in range(5):
            sync.routed("w0", [1, 2, 3], "s", hold_s=62.0)
            sync.settled("w0", [1, 2, 3], 2.0)
            await asyncio.sleep(0.1)
        assert not any(t.done() for t in tasks)  # still trying, nothing raised
        warnings = [r for r in caplog.records if "replica sync: cannot" in r.getMessage()]
        assert len(warnings) == 2, warnings  # once per loop, not once per retry
        assert sync.peer_loads().get("w0") is None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_a_flush_is_one_stream_entry_and_single_entries_still_read() -> None:
    import msgpack

    chain = np.asarray([7, 8], dtype="<u8").tobytes()
    batch = {b"g": b"p1.a", b"b": msgpack.packb([{"w": "w0", "c": chain, "t": "2"}, {"l": "{}"}])}
    entries = list(replicas.unbatched(batch))
    assert entries == [
        {b"w": b"w0", b"c": chain, b"t": b"2", b"g": b"p1.a"},
        {b"l": b"{}", b"g": b"p1.a"},
    ]
    # An entry as replicas before batching wrote it (a replica mid-upgrade) reads as is.
    single = {b"g": b"old", b"w": b"w0", b"t": b"2"}
    assert list(replicas.unbatched(single)) == [single]
    for bad in (b"\xc1", msgpack.packb({"w": "w0"}), msgpack.packb([1, 2])):
        with pytest.raises(ValueError):
            list(replicas.unbatched({b"g": b"x", b"b": bad}))


async def test_a_long_flush_goes_in_batches_a_peer_applies_in_order(redis_url: str) -> None:
    import redis.asyncio as aioredis

    from gateway.routing.index import BlockIndex
    from gateway.routing.replicas import MAX_BATCH, ReplicaSync
    from gateway.routing.sessions import SessionMap

    key = f"{namespace()}:routes"

    def sync() -> ReplicaSync:
        return ReplicaSync(
            lambda: aioredis.Redis.from_url(redis_url),
            key,
            BlockIndex(),
            SessionMap(60.0),
            {},
            speculative_ttl_s=2.0,
            known_worker=lambda w: True,
        )

    a, b = sync(), sync()
    routes = 2 * MAX_BATCH + 10
    for i in range(routes):  # one flush's worth: the publisher is not running yet
        a.routed(f"w{i % 3}", [i + 1], f"s{i}", hold_s=5.0)
    tasks = b.start()
    redis = aioredis.Redis.from_url(redis_url)
    try:
        # b follows from its first read on: a's flush must come after it.
        async def probe() -> None:
            while b.applied == 0:
                await redis.xadd(key, {"g": "probe", "l": "{}"})
                await asyncio.sleep(0.05)

        await asyncio.wait_for(probe(), 10.0)
        tasks += a.start()
        last = f"s{routes - 1}"  # entries apply in order: the last one, then all
        await eventually(
            lambda: b.sessions.get(last, time.monotonic()) is not None,
            what="every route applied at b",
        )
        stream = await redis.xrange(key)
        mine = [fields for _, fields in stream if fields[b"g"] == a.gateway_id.encode()]
        sizes = [len(list(replicas.unbatched(fields))) for fields in mine]
        assert sizes[:3] == [MAX_BATCH, MAX_BATCH, routes - 2 * MAX_BATCH + 1]  # + a's loads
        now = time.monotonic()
        assert b.sessions.get(f"s{routes - 1}", now) == f"w{(routes - 1) % 3}"
        assert b.index is not None
        assert b.index.longest_prefix([routes], now) == {f"w{(routes - 1) % 3}": 1}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await redis.aclose()


class _SwallowingRedis:
    """A client that, like redis-py at times, turns the cancel of a pending command
    into a connection error and carries on."""

    def __init__(self) -> None:
        self.calls = 0
        self.swallow = True

    async def _swallow(self) -> None:
        self.calls += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
            from redis.exceptions import ConnectionError

            raise ConnectionError("connection closed while reading") from None

    async def xread(self, *args: Any, **kwargs: Any) -> None:
        await self._swallow()

    async def xadd(self, *args: Any, **kwargs: Any) -> None:
        await self._swallow()

    async def aclose(self) -> None:
        pass


async def test_a_cancel_swallowed_by_the_redis_client_still_stops_both_loops() -> None:
    clients: list[_SwallowingRedis] = []

    def factory() -> _SwallowingRedis:
        clients.append(_SwallowingRedis())
        return clients[-1]

    tasks = _lone_sync(client_factory=factory).start()
    await eventually(lambda: all(c.calls for c in clients) and len(clients) == 2, what="both busy")
    for t in tasks:
        t.cancel()
    # Without the check they retry forever: a gateway's shutdown would hang here.
    done, pending = await asyncio.wait(tasks, timeout=5.0)
    for c in clients:  # so that a failing run still ends
        c.swallow = False
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert not pending
    assert all(t.cancelled() for t in done)
    assert [c.calls for c in clients] == [1, 1]  # no retry after the cancel


def _lone_sync(
    loads: dict[str, Any] | None = None, client_factory: Callable[[], Any] = lambda: None
) -> Any:
    """A replica on its own under "t:routes", with no Redis unless ``client_factory`` gives
    one."""
    from gateway.routing.index import BlockIndex
    from gateway.routing.replicas import ReplicaSync
    from gateway.routing.sessions import SessionMap

    return ReplicaSync(
        client_factory,
        "t:routes",
        BlockIndex(),
        SessionMap(60.0),
        {} if loads is None else loads,
        speculative_ttl_s=2.0,
        known_worker=lambda w: True,
    )


def test_a_changes_entry_names_only_the_workers_that_changed() -> None:
    import json

    from gateway.routing.load import GatewayLoad

    loads = {f"w{i}": GatewayLoad(inflight=2, pending=1) for i in range(100)}
    sync = _lone_sync(loads)
    assert set(json.loads(sync._loads_entry(True)["l"])) == set(loads)  # the whole view
    sync.routed("w7", [1], "s", 5.0)
    loads["w7"].inflight += 1
    loads["w9"].inflight = loads["w9"].pending = 0
    sync.finished("w9")
    entry = sync._loads_entry(False)
    assert json.loads(entry["d"]) == {"w7": [3, 1, 0], "w9": [0, 0, 0]}
    assert json.loads(entry["f"]) == {"w9": 1}
    assert json.loads(sync._loads_entry(False)["d"]) == {}  # nothing since


def test_peer_totals_follow_whole_views_changes_and_expiry() -> None:
    import json
    import random

    rng = random.Random(7)
    sync = _lone_sync()
    workers = [f"w{i}" for i in range(12)]
    truth: dict[str, dict[str, list[int]]] = {"p1": {}, "p2": {}, "p3": {}}
    heard: dict[str, float] = {}
    now = 1000.0
    for _ in range(400):
        now += rng.uniform(0.0, 0.4)
        gid = rng.choice(list(truth))
        if rng.random() < 0.05:  # this peer goes quiet: it ages out, and comes back whole
            now += replicas.PEER_TTL_S + 0.1
            sync.expire(now)
            truth = {g: v if _heard(heard, g, now) else {} for g, v in truth.items()}
        view = truth[gid]
        changed = rng.sample(workers, rng.randint(1, 4))
        for wid in changed:
            counts = [rng.randint(0, 3), rng.randint(0, 2), 0]
            counts[2] = counts[1] * 100
            if counts[0] or counts[1]:
                view[wid] = counts
            else:
                view.pop(wid, None)
        whole = gid not in heard or not _heard(heard, gid, now) or rng.random() < 0.2
        if whole:
            fields = {b"g": gid.encode(), b"l": json.dumps(view).encode()}
        else:
            delta = {w: view.get(w, [0, 0, 0]) for w in changed}
            fields = {b"g": gid.encode(), b"d": json.dumps(delta).encode()}
        sync.apply(fields, now)
        heard[gid] = now
        for wid in workers:
            expected = [0, 0, 0]
            for g, v in truth.items():
                if _heard(heard, g, now):
                    expected = [a + b for a, b in zip(expected, v.get(wid, [0, 0, 0]), strict=True)]
            got = sync.peer_loads().get(wid)
            as_list = (
                [0, 0, 0]
                if got is None
                else [got.inflight, got.pending, got.pending_prefill_tokens]
            )
            assert as_list == expected, (wid, as_list, expected)
    assert sync.rank()[1] == 1 + sum(_heard(heard, g, now) for g in truth)


def _heard(heard: dict[str, float], gid: str, now: float) -> bool:
    return gid in heard and now - heard[gid] <= replicas.PEER_TTL_S


def test_a_malformed_loads_entry_changes_nothing() -> None:
    sync = _lone_sync()
    sync.apply({b"g": b"p1", b"l": b'{"w0": [2, 1, 50]}'}, 10.0)
    for bad in (b'{"w0": [1, 0, 0], "w1": ["x"]}', b'{"w0": [1]}', b"[1, 2]", b"{"):
        with pytest.raises((ValueError, IndexError, AttributeError)):
            sync.apply({b"g": b"p1", b"d": bad}, 10.5)
    p = sync.peer_loads().get("w0")
    assert p is not None and (p.inflight, p.pending, p.pending_prefill_tokens) == (2, 1, 50)
    assert sync.peer_loads().get("w1") is None
