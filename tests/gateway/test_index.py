"""BlockIndex: exact longest-prefix walks over real and speculative entries."""

from __future__ import annotations

from gateway.routing.index import BlockIndex


def test_longest_prefix_counts_from_block_zero() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2, 3, 4, 5])
    index.add("c", [2, 3, 4])  # no block 0: never a hit
    assert index.longest_prefix([1, 2, 3, 4, 5, 6]) == {"a": 3, "b": 5}
    assert index.longest_prefix([1, 9, 3]) == {"a": 1, "b": 1}
    assert index.longest_prefix([9, 1]) == {}
    assert index.longest_prefix([]) == {}


def test_a_hole_in_the_chain_ends_the_run() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 4, 5])
    assert index.longest_prefix([1, 2, 3, 4, 5]) == {"a": 2}


def test_remove_clear_replace_drop() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    index.remove("a", [2, 99])
    assert index.longest_prefix([1, 2, 3]) == {"a": 1, "b": 2}
    index.replace("a", [1, 2, 3, 4])
    assert index.block_count("a") == 4
    assert index.longest_prefix([1, 2, 3, 4]) == {"a": 4, "b": 2}
    index.clear("b")
    assert index.block_count("b") == 0 and "b" in index.workers()
    index.drop("a")
    assert index.workers() == ["b"]
    assert index.longest_prefix([1, 2, 3]) == {}
    index.add("a", [1, 1, 1])  # idempotent
    assert index.block_count("a") == 1


def test_speculative_entries_expire() -> None:
    index = BlockIndex()
    index.add("a", [1])
    index.speculate("b", [1, 2, 3], now=100.0, ttl=2.0)
    assert index.longest_prefix([1, 2, 3], now=101.0) == {"a": 1, "b": 3}
    assert index.longest_prefix([1, 2, 3], now=102.5) == {"a": 1}
    assert index.longest_prefix([1, 2, 3]) == {"a": 1}  # no clock: real entries only
    assert index.block_count("b") == 0  # speculation is not a real block
    assert index.prune(now=102.5) == 3
    assert index.speculative_count() == 0


def test_speculation_off_and_drop_clears_it() -> None:
    index = BlockIndex()
    index.speculate("a", [1], now=0.0, ttl=0.0)
    assert index.speculative_count() == 0
    index.add("a", [])
    index.speculate("a", [1, 2], now=0.0, ttl=5.0)
    index.drop("a")
    assert index.longest_prefix([1, 2], now=1.0) == {}


def test_withdrawn_speculation_is_gone_at_once_and_pruned_once() -> None:
    index = BlockIndex()
    index.speculate("a", [1, 2, 3], now=0.0, ttl=60.0)
    index.speculate("b", [1, 2], now=0.0, ttl=60.0)
    index.withdraw("a", [1, 2, 3])
    assert index.longest_prefix([1, 2, 3], now=1.0) == {"b": 2}
    assert index.speculative_count() == 2
    index.withdraw("a", [1, 2, 3])  # twice: nothing more to forget
    assert index.speculative_count() == 2
    # The grace after a first token shortens a hold; the hold's heap item finds it gone.
    index.speculate("b", [1, 2], now=1.0, ttl=2.0)
    assert index.prune(now=3.5) == 2 and index.speculative_count() == 0
    assert index.prune(now=100.0) == 0 and index.speculative_count() == 0


def _reference_prefix(model: dict[str, set[int]], chain: list[int]) -> dict[str, int]:
    out = {}
    for w, held in model.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        if n:
            out[w] = n
    return out


def test_index_equals_a_plain_model_after_any_sequence_of_events() -> None:
    # Real 64-bit hashes and tiny ones (they share shards and probe runs), 70
    # workers (bitsets past one machine word), every operation interleaved with
    # partial sweeps and table rebuilds; and speculative holds (a lookup ORs each
    # hash's cached bitset of speculating workers while the ordinals and expiries
    # allow it) renewed, shortened, withdrawn and pruned while clears, replaces,
    # staged reloads and drops renumber workers. The model: real sets, plus
    # (worker, hash) -> expiry.
    import random

    for seed in range(4):
        rnd = random.Random(seed)
        index, model = BlockIndex(), {}  # type: BlockIndex, dict[str, set[int]]
        spec: dict[tuple[str, int], float] = {}
        now = 0.0
        pool = [rnd.getrandbits(64) for _ in range(400)] + list(range(30))
        workers = [f"w{i}" for i in range(70)]
        for step in range(3000):
            op, w = rnd.random(), rnd.choice(workers)
            hashes = rnd.sample(pool, rnd.randint(0, 40))
            if rnd.random() < 0.3:  # a speculative hold's life, or time passing
                chain = sorted(model.get(w, ()))[: rnd.randint(0, 8)] + pool[: rnd.randint(1, 12)]
                if op < 0.5:
                    ttl = rnd.choice([0.5, 2.0, 8.0])
                    at = now - rnd.choice([0.0, 0.0, 0.6])  # a clock read before a lookup
                    index.speculate(w, chain, at, ttl)
                    spec.update({(w, h): at + ttl for h in chain})
                elif op < 0.65:
                    index.withdraw(w, chain)
                    for h in chain:
                        spec.pop((w, h), None)
                elif op < 0.8:
                    index.prune(now)
                else:
                    now += rnd.choice([0.1, 0.7, 3.0])
                    probe = pool[: rnd.randint(1, 14)]
                    held = {
                        x: model.get(x, set())
                        | {h for (y, h), e in spec.items() if y == x and e > now}
                        for x in workers
                    }
                    assert index.longest_prefix(probe, now) == _reference_prefix(held, probe)
                continue
            if op < 0.5:
                index.add(w, hashes)
                model.setdefault(w, set()).update(hashes)
            elif op < 0.8:
                index.remove(w, hashes)
                model.get(w, set()).difference_update(hashes)
            elif op < 0.85:
                index.clear(w)
                model[w] = set()
            elif op < 0.9:
                index.replace(w, hashes)
                model[w] = set(hashes)
            elif op < 0.93:
                if w in model:
                    index.drop(w)
                    del model[w]
                    spec = {k: v for k, v in spec.items() if k[0] != w}
            elif op < 0.96:
                # A staged reload: invisible until commit, and other workers' edits
                # to shared hashes in between must not lose its entries.
                staged = index.stage(w)
                staged.add(hashes[: len(hashes) // 2])
                other = rnd.choice(workers)
                index.remove(other, hashes[:3])
                model.get(other, set()).difference_update(hashes[:3])
                staged.add(hashes[len(hashes) // 2 :])
                if rnd.random() < 0.8:
                    staged.commit()
                    model[w] = set(hashes)
                else:
                    staged.abort()
            else:
                index.maintain(rnd.randint(1, 400))
            if step % 3 == 0:  # a hot chain, walked again and again (remembered holders)
                hot = pool[: rnd.randint(1, 20)]
                assert index.longest_prefix(hot) == _reference_prefix(model, hot)
                # Right after a walk (remembered holders) its real depth per worker;
                # speculative holds never count there.
                for x in rnd.sample(workers, 3):
                    depth = _reference_prefix({x: model.get(x, set())}, hot).get(x, 0)
                    assert index.real_depth(x, hot) == depth
            if step % 25 == 0:
                owner = rnd.choice(workers)
                chain = sorted(model.get(owner, ()))[:8] + rnd.sample(pool, 3)
                depth = _reference_prefix({owner: model.get(owner, set())}, chain).get(owner, 0)
                assert index.real_depth(owner, chain) == depth  # not walked: table probes
                assert index.longest_prefix(chain) == _reference_prefix(model, chain)
                assert all(index.block_count(x) == len(model.get(x, ())) for x in workers)
                assert index.workers() == sorted(model)
                h = rnd.choice(pool)
                assert index.holds(w, h) == (h in model.get(w, ()))
                assert index.stats().entries == sum(len(s) for s in model.values())
        while index.maintain(100):
            pass
        assert index.stats().dead_ordinals == 0
        chain = sorted(next(iter(model.values()), ()))[:5]
        assert index.longest_prefix(chain) == _reference_prefix(model, chain)


def test_real_depth_counts_the_workers_real_blocks_from_block_zero() -> None:
    import numpy as np

    for bound in (0, 1000):  # remembered walks, and a memory-bound index (table probes)
        index = BlockIndex(max_entries=bound)
        index.add("a", [1, 2, 3, 5])
        index.add("b", [1, 2])  # block 1 and 2 shared: bitsets
        index.speculate("a", [1, 2, 3, 4, 5], now=0.0, ttl=10.0)
        index.speculate("c", [1, 2], now=0.0, ttl=10.0)
        assert index.longest_prefix([1, 2, 3, 4, 5], now=1.0) == {"a": 5, "b": 2, "c": 2}
        ticks = [np.asarray(s.ticks).copy() for s in index._shards if s.ticks is not None]
        remembered = sum(len(s.recent) for s in index._shards)
        assert index.real_depth("a", [1, 2, 3, 4, 5]) == 3  # 4 is only speculative
        assert index.real_depth("b", [1, 2, 3]) == 2
        assert index.real_depth("c", [1, 2]) == 0  # speculation alone
        assert index.real_depth("zz", [1, 2]) == 0  # unknown worker
        assert index.real_depth("a", [9, 1]) == 0 and index.real_depth("a", []) == 0
        # Not a look-up: nothing stamped for eviction, nothing remembered.
        after = [np.asarray(s.ticks) for s in index._shards if s.ticks is not None]
        assert all((x == y).all() for x, y in zip(ticks, after, strict=True))
        assert sum(len(s.recent) for s in index._shards) == remembered
        index.remove("a", [2])
        assert index.real_depth("a", [1, 2, 3]) == 1  # the remembered holders were forgotten


def test_a_hold_renewed_with_an_earlier_clock_read_still_counts() -> None:
    # A lookup at 1.5 finds a's hold (until 1.0) expired; a renewal whose clock was
    # read at 0.8 (before that lookup) must count again, though 1.0 > 0.8.
    index = BlockIndex()
    index.speculate("a", [1], now=0.0, ttl=1.0)
    assert index.longest_prefix([1], now=1.5) == {}
    index.speculate("a", [1], now=0.8, ttl=5.0)
    assert index.longest_prefix([1], now=2.0) == {"a": 1}
    assert index.longest_prefix([1], now=6.0) == {}


def test_prune_touches_only_what_expired() -> None:
    index = BlockIndex()
    index.speculate("a", [1, 2], now=0.0, ttl=1.0)
    index.speculate("b", [2, 3], now=0.0, ttl=5.0)
    index.speculate("a", [2], now=0.5, ttl=3.0)  # renews a's entry for block 2
    assert index.speculative_count() == 4
    assert index.prune(now=0.9) == 0
    assert index.prune(now=1.0) == 1  # a's block 1; its block 2 was renewed
    assert index.longest_prefix([2, 3], now=2.0) == {"a": 1, "b": 2}
    assert index.prune(now=3.5) == 1
    assert index.longest_prefix([2, 3], now=3.6) == {"b": 2}
    assert index.prune(now=10.0) == 2 and index.speculative_count() == 0


def test_memory_bound_evicts_least_recently_looked_up() -> None:
    index = BlockIndex(max_entries=2000)
    hot = list(range(1, 201))
    index.add("a", hot)
    for n in range(20):
        index.add("a", list(range(10_000 * (n + 1), 10_000 * (n + 1) + 200)))
        index.longest_prefix(hot)  # the hot chain stays recently used
    stats = index.stats()
    assert stats.entries <= 2000 and stats.evictions >= 2200
    assert index.block_count("a") == stats.entries
    assert index.longest_prefix(hot) == {"a": 200}


def test_stats_count_entries_and_shared_hashes() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [2, 3])
    stats = index.stats()
    assert (stats.entries, stats.hashes, stats.shared_hashes) == (5, 3, 2)
    assert stats.bytes > 0 and stats.evictions == 0


def test_prune_with_a_limit_goes_in_slices() -> None:
    index = BlockIndex()
    for n in range(10):
        index.speculate(f"w{n}", list(range(100)), now=0.0, ttl=1.0)
    assert index.prune(now=5.0, limit=250) == 300  # whole chains: stops at the first past 250
    assert index.speculative_count() == 700
    assert index.longest_prefix([0, 1], now=5.0) == {}  # expired entries never count
    assert index.prune(now=5.0) == 700


def test_a_lookup_names_every_holder_of_a_widely_held_chain() -> None:
    # Past a few dozen workers in one bitset the holders are found with numpy
    # (``_name_many``); the same answer as the plain model, at every depth, with
    # speculating workers among them.
    import random

    rnd = random.Random(5)
    index, model = BlockIndex(), {}  # type: BlockIndex, dict[str, set[int]]
    chain = [rnd.getrandbits(64) for _ in range(12)]
    for i in range(300):
        w = f"w{i}"
        depth = rnd.choice([0, 3, 3, 7, 12, 12, 12])
        if rnd.random() < 0.2:
            index.speculate(w, chain[:depth], 0.0, 5.0)
        else:
            index.add(w, chain[:depth])
        model[w] = set(chain[:depth])
    found = index.longest_prefix(chain, 1.0)
    assert found == _reference_prefix(model, chain)
    assert sum(1 for n in found.values() if n == 12) > 64  # the wide case, really
    assert list(found) == sorted(found, key=lambda w: (found[w], int(w[1:])))  # the loop's order


def test_a_walk_remembers_holders_only_until_they_change() -> None:
    # Each way a hash's holders change, right after a walk remembered them: a
    # single holder's removal, a shared hash losing one, and a dead worker's
    # ordinal swept and given to a new worker (which holds nothing of it).
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    assert index.longest_prefix([1, 2, 3]) == {"a": 3}
    index.remove("a", [2])
    assert index.longest_prefix([1, 2, 3]) == {"a": 1}
    index.add("b", [1, 2])
    assert index.longest_prefix([1, 2, 3]) == {"a": 1, "b": 2}
    index.remove("b", [1])
    assert index.longest_prefix([1, 2, 3]) == {"a": 1}
    index.drop("a")
    while index.maintain(1024):
        pass
    index.add("c", [9])  # a's ordinal again
    assert index.longest_prefix([1, 2, 3]) == {}
    index.add("c", [1])
    assert index.longest_prefix([1, 2, 3]) == {"c": 1}
