"""The KV block pool: which block holds what, who uses it, and which to evict next.

A fixed array of ``num_blocks`` blocks. A block in use has ``ref_cnt > 0``
(one reference per sequence whose block table holds it, plus one per pin).
A full block whose tokens are computed is *cached*: it carries the chain hash
of its tokens and the tokens themselves, and the hash map points at it, so a
later sequence with the same prefix can share it.

Free blocks wait in an LRU list (an ``OrderedDict`` used as an O(1) doubly
linked list). A freed block keeps its hash (lazy eviction): it stays a cache
hit until ``allocate`` takes it for new content, which is the one place a
cached block is evicted. Callers free a finished sequence's blocks tail-first,
so under pressure the end of a prompt goes before its shared beginning.

Every change the gateway must hear about is recorded as a ``contract.events``
event on the line that makes it; the engine drains them once per step with
``take_events``. Running out of blocks is a return value (``None``/``False``),
never an exception. No torch here: the pool only does bookkeeping.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contract.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Block:
    """One KV block's bookkeeping (its tensors live in the model runner)."""

    block_id: int
    ref_cnt: int = 0
    pin_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Allocation, prefix-cache lookup, pinning and eviction over a fixed set of blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"--num-blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Least recently freed first; the value is unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, Block] = {}
        self._num_pinned = 0
        self._events: list[KVEvent] = []
        self.evictions_total = 0

    # -- counters (O(1)) -------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (cached or not): what ``allocate`` can hand out."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with at least one reference (pinned blocks included)."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a hashed, reusable full block (in use or free)."""
        return len(self._by_hash)

    @property
    def num_pinned_blocks(self) -> int:
        return self._num_pinned

    def resident_hashes(self) -> set[int]:
        """Every hash the pool can serve right now (what the gateway's index should hold)."""
        return set(self._by_hash)

    # -- lookup ----------------------------------------------------------

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block for ``block_hash`` if it really holds ``token_ids``.

        The stored tokens are compared so that a 64-bit hash collision can
        never hand a sequence another prompt's KV.
        """
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        if block.token_ids != tuple(token_ids):
            logger.warning("block hash collision on %016x: cached tokens differ", block_hash)
            return None
        return block

    def match_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest confirmed run of cached blocks from block 0."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i, block_hash in enumerate(block_hashes):
            block = self.lookup(block_hash, token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block.block_id)
        return hits

    def can_allocate(self, num_new: int, hit_ids: Iterable[int] = ()) -> bool:
        """Whether ``num_new`` fresh blocks fit after taking references on ``hit_ids``.

        A hit that sits in the free list stops being allocatable once it is
        touched, so it counts against the free blocks.
        """
        reclaimed = sum(1 for i in hit_ids if self.blocks[i].ref_cnt == 0)
        return num_new <= len(self._free) - reclaimed

    # -- references ------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes a reference on each block (cache hits), pulling free ones out of the LRU."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def allocate(self, num: int) -> list[int] | None:
        """``num`` fresh blocks (one reference each), least recently freed first.

        Returns ``None`` and changes nothing when fewer are free. Taking a
        block that still carries a hash evicts that cached content here.
        """
        if num > len(self._free):
            return None
        ids: list[int] = []
        evicted: list[int] = []
        for _ in range(num):
            block_id, _unused = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                self._forget(block, block.block_hash)
            block.ref_cnt = 1
            ids.append(block_id)
        if evicted:
            self.evictions_total += len(evicted)
            self._events.append(BlockRemoved(tuple(evicted)))
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference per block, in the given order.

        Blocks that reach zero go to the back of the LRU (evicted last) and
        keep their hash. Pass a sequence's table reversed to free it
        tail-first, so its prefix outlives its suffix.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def pin(self, block_ids: Iterable[int]) -> None:
        """Holds blocks in the pool until ``unpin``: a pinned block is never evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.pin_cnt == 0:
                self._num_pinned += 1
            block.pin_cnt += 1
            self.touch((block_id,))

    def unpin(self, block_ids: Iterable[int]) -> int:
        """Releases one pin on each pinned block among ``block_ids``; returns how many."""
        released = 0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.pin_cnt == 0:
                continue
            block.pin_cnt -= 1
            if block.pin_cnt == 0:
                self._num_pinned -= 1
            self.free((block_id,))
            released += 1
        return released

    # -- caching ---------------------------------------------------------

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        parent_hash: int | None,
    ) -> int:
        """Registers computed full blocks (in chain order) as reusable cache entries.

        ``token_ids`` are the blocks' tokens back to back; ``parent_hash`` is
        the hash of the block before the first (``None`` at the start of a
        chain). A hash already served by another block (the same prefix
        computed twice, or a collision) is not registered again, so each
        ``BlockStored`` event covers a run of blocks that are new to the
        index. Returns the number of blocks registered.
        """
        if not self.enable_caching:
            return 0
        bs = self.block_size
        run: list[int] = []
        run_parent = parent_hash
        stored = 0
        for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes, strict=True)):
            block = self.blocks[block_id]
            if block.block_hash is None and block_hash not in self._by_hash:
                block.block_hash = block_hash
                block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
                self._by_hash[block_hash] = block
                run.append(block_hash)
                stored += 1
            else:
                if run:
                    self._events.append(BlockStored(tuple(run), run_parent))
                run = []
                run_parent = block_hash
        if run:
            self._events.append(BlockStored(tuple(run), run_parent))
        return stored

    def reset(self) -> bool:
        """Forgets every cached block; ``False`` (nothing changed) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._by_hash.values():
            block.block_hash = None
            block.token_ids = ()
        self._by_hash.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _forget(self, block: Block, block_hash: int) -> None:
        if self._by_hash.get(block_hash) is block:
            del self._by_hash[block_hash]
        block.block_hash = None
        block.token_ids = ()
