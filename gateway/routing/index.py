"""The gateway's in-memory block index: which worker holds which block hash.

A mirror of every worker's Redis block set (``gateway.routing.mirror`` keeps it
current), plus *speculative* entries: right after a request is routed to a
worker, that worker is assumed to hold the request's blocks for a few
seconds, so a burst of siblings stays together before the real events land.

Sized for fleets of 1,000 workers x 100k blocks (10^8 entries):

- Workers are *ordinals* (small ints). Each block hash maps to its holders:
  one ordinal (most blocks live on one worker) or, when shared, a Python int
  used as a bitset of ordinals. Hashes live in open-addressing tables of
  flat numpy arrays (key u64, holder i32, last-use tick u32), split into
  ``hash_table.SHARDS`` shards by the hash's low bits so growing one shard never
  stalls the loop for long. About 25-30 bytes per (worker, block) entry,
  against ~350 for Python dicts of sets.
- A lookup walks the request's chain, intersecting holder bitsets, and stops
  at the first block no candidate holds: O(chain length), never O(fleet).
- ``clear``/``replace`` give the worker a fresh ordinal; the old ordinal's
  entries are invisible at once and swept from the tables incrementally by
  ``maintain`` (a reload never rewrites the index in one go).
- Speculative entries expire from a heap ordered by expiry: ``prune`` costs
  O(expired), not O(all).
- ``max_entries`` bounds memory: past it, each insert evicts the least
  recently looked-up entries of its shard (a chain looked up together shares
  a tick, so chains go together).

Not thread-safe: it lives on the gateway's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np

from gateway.routing.hash_table import (
    EMPTY,
    MAX_LOAD,
    SHARD_BITS,
    SHARD_MASK,
    SHARDS,
    SHARED,
    TOMB,
    Shard,
)
from gateway.routing.index_upkeep import IndexUpkeep
from gateway.routing.speculation import (
    BITS,
    COMPUTED,
    GENERATION,
    INF,
    SOONEST,
    Speculation,
)


@dataclass(frozen=True)
class IndexStats:
    """Size of the index, for metrics and benchmarks."""

    entries: int  # live (worker, block) pairs
    hashes: int  # distinct block hashes with at least one live holder
    shared_hashes: int  # hashes held by more than one worker
    speculative: int  # speculative (worker, block) pairs, expired ones included until pruned
    bytes: int  # estimated memory of tables, shared bitsets and speculative entries
    evictions: int  # entries dropped by the memory bound since start
    dead_ordinals: int  # cleared/dropped worker generations not yet swept


class StagedSet:
    """A worker's block set being loaded: ``add`` slices, then ``commit`` (or ``abort``)."""

    def __init__(self, index: BlockIndex, worker_id: str, ordinal: int) -> None:
        self.index, self.worker_id, self.ordinal = index, worker_id, ordinal
        self.done = False

    def add(self, hashes: Iterable[int]) -> None:
        self.index._add(self.ordinal, hashes)

    def commit(self) -> None:
        """Makes the staged set the worker's blocks, atomically for lookups."""
        if not self.done:
            self.done = True
            self.index._commit(self)

    def abort(self) -> None:
        """Discards the staged set (the worker went away or a newer load began)."""
        if not self.done:
            self.done = True
            self.index._abort(self)


class BlockIndex(IndexUpkeep):
    """Block hashes per worker, real and speculative."""

    def __init__(self, max_entries: int = 0) -> None:
        if max_entries < 0:
            raise ValueError("--index-max-entries must be >= 0 (0 = unbounded)")
        self.max_entries = max_entries
        self._shards = [Shard(ticks=max_entries > 0) for _ in range(SHARDS)]
        self._ord: dict[str, int] = {}  # worker -> its current ordinal
        self._ord_changes = 0  # bumped whenever _ord changes (block_counts' cache)
        self._counts_of: tuple[list[str], int, Callable[[list[int]], Any]] | None = None
        self._names: list[str | None] = []  # ordinal -> worker (None: dead or free)
        self._counts: list[int] = []  # ordinal -> live real entries
        self._free: list[int] = []
        self._dead: set[int] = set()  # ordinals whose entries still sit in the tables
        self._sweeping: set[int] = set()  # dead ordinals the current sweep pass removes
        self._sweep_at = 0  # next shard the sweep visits
        self._known: set[str] = set()  # workers with real entries (or a clear) on record
        self._live_bits = 0  # bitset of ordinals that name a worker
        # Bumped whenever an ordinal stops naming its worker: speculative entries' bitsets
        # computed before are stale.
        self._generation = 0
        self._staging_bits = 0  # ordinals being filled by ``stage`` (invisible to lookups)
        self._entries = 0
        self._evictions = 0
        self._tick = 1
        self._stagings = 0  # stage() calls so far (a unique name per staged ordinal)
        self._spec = Speculation()
        # Each shard remembers the real holders of its recently looked-up hashes
        # (``Shard.recent``, at most _RECENT_PER_SHARD), so a walk over a chain seen
        # before is a dict read per block instead of a table probe (a 380-block chain:
        # ~3x faster). Whatever changes a hash's holders forgets it there; an ordinal's
        # reuse forgets everything. A memory-bound index remembers nothing: its
        # lookups must stamp each slot's last use for eviction.
        self._remember = max_entries == 0

    # -- ordinals ------------------------------------------------------------------

    def _ordinal(self, worker_id: str) -> int:
        o = self._ord.get(worker_id)
        if o is None:
            if self._free:
                o = self._free.pop()
                for shard in self._shards:  # remembered holders may name its old worker
                    shard.recent.clear()
                self._names[o] = worker_id
                self._counts[o] = 0
            else:
                o = len(self._names)
                self._names.append(worker_id)
                self._counts.append(0)
            self._ord[worker_id] = o
            self._ord_changes += 1
            self._live_bits |= 1 << o
        return o

    def _retire(self, worker_id: str) -> None:
        """Makes the worker's current ordinal dead: its entries vanish from lookups now."""
        o = self._ord.pop(worker_id, None)
        if o is None:
            return
        self._generation += 1
        self._ord_changes += 1
        self._entries -= self._counts[o]
        self._counts[o] = 0
        self._names[o] = None
        self._live_bits &= ~(1 << o)
        self._dead.add(o)

    # -- real entries (from Redis) ---------------------------------------------

    def add(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Records that ``worker_id`` now holds ``hashes`` (idempotent)."""
        self._known.add(worker_id)
        self._add(self._ordinal(worker_id), hashes)

    def _add(self, o: int, hashes: Iterable[int]) -> None:
        bit = 1 << o
        self._tick = tick = (self._tick + 1) & 0xFFFFFFFF
        names, shards = self._names, self._shards
        added = 0
        for h in hashes:
            shard = shards[h & SHARD_MASK]
            i, found = shard.find_or_slot(h)
            if found:
                v = shard.vals[i]
                if v == o:
                    continue
                shard.recent.pop(h, None)
                if v >= 0:
                    if names[v] is None:
                        shard.vals[i] = o  # the old holder is a dead generation
                    else:
                        shard.shared[h] = (1 << v) | bit
                        shard.vals[i] = SHARED
                else:
                    bits = shard.shared[h]
                    if bits & bit:
                        continue
                    shard.shared[h] = bits | bit
                added += 1
                continue
            shard.recent.pop(h, None)
            if shard.vals[i] == EMPTY:
                shard.used += 1
            shard.keys[i] = h
            shard.vals[i] = o
            if shard.ticks is not None:
                shard.ticks[i] = tick
            shard.live += 1
            added += 1
            if shard.used > shard.cap * MAX_LOAD:
                shard.rebuild(self._dead_array())
            if self.max_entries and self._entries + added > self.max_entries:
                self._counts[o] += added
                self._entries += added
                added = 0
                self._evict(shard)
        self._counts[o] += added
        self._entries += added

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Records that ``worker_id`` evicted ``hashes`` (unknown hashes are ignored)."""
        o = self._ord.get(worker_id)
        if o is None:
            return
        bit = 1 << o
        gone = 0
        for h in hashes:
            shard = self._shards[h & SHARD_MASK]
            i = shard.find(h)
            if i < 0:
                continue
            v = shard.vals[i]
            if v == o:
                shard.vals[i] = TOMB
                shard.live -= 1
                gone += 1
                shard.recent.pop(h, None)
            elif v == SHARED:
                bits = shard.shared[h]
                if not bits & bit:
                    continue
                gone += 1
                self._set_bits(shard, i, h, bits & ~bit)
        self._counts[o] -= gone
        self._entries -= gone

    def _set_bits(self, shard: Shard, i: int, h: int, bits: int) -> None:
        """Stores a shared slot's new holders, demoting it to one ordinal or none."""
        shard.recent.pop(h, None)
        bits &= self._live_mask() | self._staging_bits
        if bits & (bits - 1):
            shard.shared[h] = bits
            return
        del shard.shared[h]
        if bits:
            shard.vals[i] = bits.bit_length() - 1
        else:
            shard.vals[i] = TOMB
            shard.live -= 1

    def clear(self, worker_id: str) -> None:
        """Forgets every real block of ``worker_id`` (it stays known, holding nothing)."""
        self._retire(worker_id)
        self._known.add(worker_id)

    def replace(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Sets ``worker_id``'s blocks to exactly ``hashes`` (a reload from its Redis set)."""
        self.clear(worker_id)
        self.add(worker_id, hashes)

    def stage(self, worker_id: str) -> StagedSet:
        """Starts a reload of ``worker_id`` that lookups do not see until ``commit``.

        The mirror fills it in slices between awaits, so a 100k-block reload
        never stalls the loop, and routing keeps the worker's old blocks until
        the new ones are complete.
        """
        o = self._ordinal(f"\0staging:{worker_id}:{self._stagings}")
        self._stagings += 1
        self._live_bits &= ~(1 << o)
        self._staging_bits |= 1 << o
        return StagedSet(self, worker_id, o)

    def _commit(self, staged: StagedSet) -> None:
        o = staged.ordinal
        self._staging_bits &= ~(1 << o)
        del self._ord[self._names[o]]  # type: ignore[arg-type]
        self._retire(staged.worker_id)
        self._names[o] = staged.worker_id
        self._ord[staged.worker_id] = o
        self._ord_changes += 1
        self._live_bits |= 1 << o
        self._known.add(staged.worker_id)

    def _abort(self, staged: StagedSet) -> None:
        self._staging_bits &= ~(1 << staged.ordinal)
        self._live_bits |= 1 << staged.ordinal
        self._retire(self._names[staged.ordinal])  # type: ignore[arg-type]

    def drop(self, worker_id: str) -> None:
        """Forgets ``worker_id`` entirely, speculative entries included (it died)."""
        self._retire(worker_id)
        self._known.discard(worker_id)
        # Its speculative entries go too; a worker re-added later starts clean.
        self._spec.drop_worker(worker_id)

    # -- speculative entries -----------------------------------------------------

    def speculate(self, worker_id: str, hashes: Sequence[int], now: float, ttl: float) -> None:
        """Assumes ``worker_id`` holds ``hashes`` until ``now + ttl`` (monotonic seconds)."""
        bit = 1 << self._ordinal(worker_id)
        self._spec.add(worker_id, hashes, now, ttl, bit, self._generation)

    def withdraw(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Forgets ``worker_id``'s speculative entries for ``hashes`` (its call failed)."""
        self._spec.withdraw(worker_id, hashes)

    def prune(self, now: float, limit: int = 0) -> int:
        """Drops expired speculative entries (``Speculation.prune``); returns how many went."""
        return self._spec.prune(now, limit)

    # -- queries -----------------------------------------------------------------

    def longest_prefix(self, hashes: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Per worker, how many blocks of the chain ``hashes`` it holds from block 0.

        Workers holding none are absent. Speculative entries count only when
        ``now`` (monotonic seconds) is given and they have not expired.
        """
        result: dict[str, int] = {}
        if not hashes:
            return result
        names, shards, generation = self._names, self._shards, self._generation
        spec = self._spec.by_hash if now is not None else None
        self._tick = tick = (self._tick + 1) & 0xFFFFFFFF
        remember = self._remember
        alive = -1
        for n, h in enumerate(hashes):
            # 1. real holders of block n (remembered, or a probe of one shard)
            shard = shards[h & SHARD_MASK]
            bits = shard.recent.get(h) if remember else None
            if bits is None:
                keys, vals, mask = shard.keys, shard.vals, shard.mask
                i = (h >> SHARD_BITS) & mask
                bits = 0
                while True:
                    v = vals[i]
                    if v == EMPTY:
                        break
                    if v != TOMB and keys[i] == h:
                        bits = (1 << v) if v >= 0 else shard.shared[h]
                        if shard.ticks is not None:
                            shard.ticks[i] = tick
                        break
                    i = (i + 1) & mask
                if remember:
                    if len(shard.recent) >= _RECENT_PER_SHARD:
                        shard.recent.clear()  # 64 at a time: no pause to forget them
                    shard.recent[h] = bits
            # 2. speculative holders that have not expired
            if spec:
                e = spec.get(h)
                if e is not None:
                    if e[GENERATION] == generation and e[SOONEST] > now:
                        bits |= e[BITS]
                    else:
                        bits |= self._speculative_bits(e, now)  # type: ignore[arg-type]
            # 3. intersect: workers whose run ended here get n blocks
            if n:
                ended = alive & ~bits
                alive &= bits
            else:
                ended = 0
                alive = bits & self._live_bits  # dead generations drop out here
            if ended:
                _name_many(result, names, ended, n)
            if not alive:
                return result
        _name_many(result, names, alive, len(hashes))
        return result

    def _speculative_bits(self, entry: dict[str, Any], now: float) -> int:
        """Recomputes a speculative entry's bitset and soonest expiry from its workers."""
        bits, soonest = 0, INF
        for w, exp in entry.items():
            if w[0] != " " and exp > now:  # not one of the entry's own keys
                bits |= 1 << self._ordinal(w)
                soonest = min(soonest, exp)
        entry[BITS], entry[SOONEST], entry[GENERATION] = bits, soonest, self._generation
        entry[COMPUTED] = now
        return bits

    def real_depth(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain ``hashes`` ``worker_id`` really holds
        (its Redis set says so; speculative entries do not count).

        The dispatcher claims only the rest speculatively: a conversation's history
        is usually cached for real already, and claiming its 380 blocks again cost
        two passes over them per request (routed, first token) and a third to expire
        them. Right after ``longest_prefix`` walked the chain its blocks are
        remembered, so this costs a dict read per held block and stops at the first
        one the worker lacks. It neither remembers nor stamps what it reads: it is
        not a look-up.
        """
        o = self._ord.get(worker_id)
        if o is None:
            return 0
        shards, remember = self._shards, self._remember
        for n, h in enumerate(hashes):
            shard = shards[h & SHARD_MASK]
            bits = shard.recent.get(h) if remember else None
            if bits is None:
                i = shard.find(h)
                if i < 0:
                    return n
                v = shard.vals[i]
                bits = (1 << v) if v >= 0 else shard.shared[h]
            if not bits >> o & 1:
                return n
        return len(hashes)

    def block_count(self, worker_id: str) -> int:
        """Real blocks the index believes ``worker_id`` holds."""
        o = self._ord.get(worker_id)
        return 0 if o is None else self._counts[o]

    def block_counts(self, worker_ids: list[str]) -> list[int]:
        """``block_count`` of each of ``worker_ids``, in order (one call for a fleet).

        The ids' ordinals are kept while the list and the ordinals stay the same
        (the dispatcher asks for the same healthy list per request): 13 vs 54 us
        at 1,000 workers.
        """
        cache = self._counts_of
        if cache is None or cache[0] is not worker_ids or cache[1] != self._ord_changes:
            if len(worker_ids) < 2:  # itemgetter of one index answers a bare value
                ordinal, counts = self._ord.get, self._counts
                return [0 if (o := ordinal(w)) is None else counts[o] for w in worker_ids]
            missing = -1  # the 0 appended to the counts below
            ords = [self._ord.get(w, missing) for w in worker_ids]
            cache = self._counts_of = (worker_ids, self._ord_changes, itemgetter(*ords))
        return list(cache[2]([*self._counts, 0]))

    def holds(self, worker_id: str, block_hash: int) -> bool:
        o = self._ord.get(worker_id)
        if o is None:
            return False
        shard = self._shards[block_hash & SHARD_MASK]
        i = shard.find(block_hash)
        if i < 0:
            return False
        v = shard.vals[i]
        return v == o or (v == SHARED and bool(shard.shared[block_hash] >> o & 1))

    def workers(self) -> list[str]:
        return sorted(self._known)

    def speculative_count(self) -> int:
        return self._spec.pairs

    def stats(self) -> IndexStats:
        """Entry counts and estimated bytes (tables + shared bitsets + speculation)."""
        table = sum(s.nbytes() for s in self._shards)
        shared = sum(len(s.shared) for s in self._shards)
        width = max(1, len(self._names)) // 8 + 40
        spec_bytes = self._spec.nbytes()
        return IndexStats(
            entries=self._entries,
            hashes=sum(s.live for s in self._shards),
            shared_hashes=shared,
            speculative=self._spec.pairs,
            bytes=table + shared * (width + 100) + spec_bytes,
            evictions=self._evictions,
            dead_ordinals=len(self._dead),
        )


# Hashes whose holders a shard remembers before it starts over: 64k in all (at
# most ~10 MB); forgetting 64 at a time costs a few us, 64k at once up to 2.8 ms.
_RECENT_PER_SHARD = 64

# Past this many workers in one bitset, ``_name_many`` finds them with numpy (a
# 1,000-worker bitset: 84 vs 232 us); below it a loop over the set bits is faster.
_FEW_BITS = 32


def _name_many(result: dict[str, int], names: list[str | None], bits: int, n: int) -> None:
    """``result[name] = n`` for the worker of every ordinal set in ``bits``."""
    if bits.bit_count() <= _FEW_BITS:
        while bits:
            low = bits & -bits
            result[names[low.bit_length() - 1]] = n  # type: ignore[index]
            bits ^= low
        return
    raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
    ordinals = np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    result.update(dict.fromkeys(map(names.__getitem__, ordinals), n))  # type: ignore[arg-type]
