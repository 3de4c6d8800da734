"""Speculation: holds whose unclaimed hashes share one entry until some are held apart."""

from __future__ import annotations

import random

from gateway.routing.index import BlockIndex
from gateway.routing.speculation import META, REFS, Speculation
from tests.gateway.test_index import _reference_prefix


def _entries(spec: Speculation) -> dict[int, dict[str, float]]:
    """hash -> {worker: expiry}, the entries' own keys left out."""
    return {
        h: {w: x for w, x in e.items() if not w.startswith(" ")} for h, e in spec.by_hash.items()
    }


def test_a_cold_chain_shares_one_entry_and_a_renewal_changes_it_once() -> None:
    spec = Speculation()
    chain = list(range(100, 475))
    spec.add("a", chain, now=0.0, ttl=62.0, bit=1, generation=0)
    entries = {id(e) for e in spec.by_hash.values()}
    assert len(entries) == 1 and spec.by_hash[100][REFS] == 375 and spec.pairs == 375
    spec.add("a", chain, now=1.0, ttl=2.0, bit=1, generation=0)  # its first token
    assert {id(e) for e in spec.by_hash.values()} == entries
    assert _entries(spec)[474] == {"a": 3.0} and spec.pairs == 375
    assert spec.prune(now=3.0) == 375 and spec.by_hash == {} and spec.pairs == 0
    assert spec.prune(now=100.0) == 0  # the routing's hold finds nothing left


def test_a_renewal_of_every_hash_supersedes_the_hold_it_renews() -> None:
    # A request's hold while it waits (first-token timeout + grace) is renewed with the
    # grace at its first token: the first hold's hashes are not kept until it expires.
    spec = Speculation()
    spec.add("a", [1, 2, 3], now=0.0, ttl=62.0, bit=1, generation=0)
    spec.add("a", [1, 2, 3], now=1.0, ttl=2.0, bit=1, generation=0)
    assert [hashes for _, hashes in spec._holds.values()] == [(1, 2, 3)]
    assert spec.nbytes() < 3 * 380 + 2 * 80 + 6 * 8
    assert spec.prune(now=3.0) == 3 and spec._holds == {} and spec.by_hash == {}
    assert spec.prune(now=62.0) == 0
    # Renewing part of it, or another worker holding all of it, keeps the first hold.
    spec.add("a", [1, 2, 3], now=100.0, ttl=62.0, bit=1, generation=0)
    spec.add("a", [1, 2], now=101.0, ttl=2.0, bit=1, generation=0)
    spec.add("b", [1, 2, 3], now=101.0, ttl=2.0, bit=2, generation=0)
    assert len(spec._holds) == 3
    assert spec.prune(now=103.0) == 5
    assert _entries(spec) == {3: {"a": 162.0}}
    assert spec.prune(now=162.0) == 1 and spec.by_hash == {} and spec._holds == {}


def test_a_hold_on_part_of_a_shared_entry_copies_just_that_part() -> None:
    spec = Speculation()
    spec.add("a", [1, 2, 3, 4], now=0.0, ttl=5.0, bit=1, generation=0)
    spec.add("b", [1, 2, 9], now=0.0, ttl=2.0, bit=2, generation=0)  # a sibling, diverging
    assert _entries(spec) == {
        1: {"a": 5.0, "b": 2.0},
        2: {"a": 5.0, "b": 2.0},
        3: {"a": 5.0},
        4: {"a": 5.0},
        9: {"b": 2.0},
    }
    assert spec.by_hash[3] is spec.by_hash[4] and spec.by_hash[3][REFS] == 2
    assert spec.by_hash[1] is not spec.by_hash[2]
    assert spec.pairs == 7
    spec.withdraw("a", [3])  # a failed request's claim, one hash of a shared entry
    assert 3 not in spec.by_hash and _entries(spec)[4] == {"a": 5.0} and spec.pairs == 6
    assert spec.prune(now=2.0) == 3 and spec.pairs == 3
    assert _entries(spec) == {1: {"a": 5.0}, 2: {"a": 5.0}, 4: {"a": 5.0}}


def test_speculation_equals_a_plain_model_of_expiring_holds() -> None:
    # Chains from a tree of prefixes (siblings share the first blocks and diverge),
    # holds on a chain's tail as the dispatcher claims them, renewed shorter at a first
    # token, withdrawn, pruned (with and without a limit) and looked up through the
    # index; after each step the entries equal the model's (worker, hash) -> expiry,
    # the pair count equals theirs, every entry's count is the number of hashes
    # pointing at it, and after a full prune no entry is empty.
    for seed in range(6):
        rnd = random.Random(seed)
        index = BlockIndex()
        spec = index._spec
        model: dict[tuple[str, int], float] = {}
        trunks = [[rnd.getrandbits(64) for _ in range(40)] for _ in range(3)]
        now = 0.0
        for _ in range(1500):
            w = f"w{rnd.randrange(6)}"
            trunk = rnd.choice(trunks)
            chain = trunk[: rnd.randint(0, 40)] + [
                rnd.getrandbits(64) for _ in range(rnd.randint(0, 6))
            ]
            claim = chain[rnd.randint(0, len(chain)) :] if rnd.random() < 0.5 else chain
            op = rnd.random()
            if op < 0.5:
                ttl = rnd.choice([0.5, 2.0, 62.0])
                index.speculate(w, claim, now, ttl)
                if claim:
                    model.update({(w, h): now + ttl for h in claim})
            elif op < 0.6:
                index.withdraw(w, claim)
                for h in claim:
                    model.pop((w, h), None)
            elif op < 0.75:
                limited = rnd.random() < 0.3
                index.prune(now, limit=50 if limited else 0)
                if not limited:
                    model = {k: x for k, x in model.items() if x > now}
                    # An entry emptied through some of its hashes is let go by the rest
                    # when the hold that set its expiry expires: by a full prune.
                    assert all(len(e) > META for e in spec.by_hash.values())
            elif op < 0.9:
                now += rnd.choice([0.1, 0.7, 3.0])
            else:
                probe = rnd.choice(trunks)[: rnd.randint(1, 40)]
                held = {
                    f"w{i}": {h for (x, h), e in model.items() if x == f"w{i}" and e > now}
                    for i in range(6)
                }
                assert index.longest_prefix(probe, now) == _reference_prefix(held, probe)
            live = {(w, h): x for h, e in _entries(spec).items() for w, x in e.items()}
            # Expired pairs not pruned yet may linger in the index; the model keeps them too
            # until a full prune, so compare the pairs that have not expired, and the counts.
            assert {k: x for k, x in live.items() if x > now} == {
                k: x for k, x in model.items() if x > now
            }
            assert spec.pairs == len(live)
            refs: dict[int, int] = {}
            for e in spec.by_hash.values():
                refs[id(e)] = refs.get(id(e), 0) + 1
            assert all(e[REFS] == refs[id(e)] for e in spec.by_hash.values())
            assert spec._held == sum(len(hashes) for _, hashes in spec._holds.values())
        index.prune(now + 100.0)
        assert spec.by_hash == {} and spec.pairs == 0 and spec._holds == {}


def test_a_repeated_hash_is_one_hash() -> None:
    # [1, 1] must not count as covering both hashes of the entry [1, 2] shares.
    spec = Speculation()
    spec.add("a", [1, 2], now=0.0, ttl=5.0, bit=1, generation=0)
    spec.add("b", [1, 1], now=0.0, ttl=5.0, bit=2, generation=0)
    assert _entries(spec) == {1: {"a": 5.0, "b": 5.0}, 2: {"a": 5.0}}
    assert spec.pairs == 3
    assert spec.prune(now=5.0) == 3 and spec.by_hash == {}
