"""Routing policies of other systems, re-implemented for the fleet simulator only.

- ``Chwbl``: consistent hashing with bounded loads on the request's first
  block, the way KubeAI's PrefixHash balancer works: a ring of virtual nodes
  per worker; walk clockwise from the key's point to the first worker whose
  in-flight count stays within ``load_factor`` x the mean (Mirrokni et al.).
- ``SglangLike``: SGLang router's ``cache_aware`` policy: the router keeps an
  approximate prefix tree per worker of the requests it sent there (it never
  sees the engines' evictions); when the fleet is imbalanced (max - min >
  ``balance_abs`` and max > ``balance_rel`` x min in-flight requests) it
  sends to the shortest queue, otherwise to the best prefix match if the match
  rate exceeds ``cache_threshold``, else to the worker with the smallest tree.
  The tree here is kept at block granularity and trimmed LRU to a size cap.

They never run in the gateway: they exist to compare kvroute against.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

import xxhash

_U64 = struct.Struct("<Q")


class Chwbl:
    """Consistent hashing with bounded loads over the first block's hash."""

    def __init__(
        self, worker_ids: Sequence[str], *, load_factor: float = 1.25, vnodes: int = 100
    ) -> None:
        if not load_factor >= 1.0:
            raise ValueError("--chwbl-load-factor must be >= 1.0")
        if not worker_ids:
            raise ValueError("no workers to route to")
        self.load_factor = load_factor
        ring = sorted(
            (xxhash.xxh3_64_intdigest(f"{wid}#{v}".encode()), wid)
            for wid in worker_ids
            for v in range(vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def choose(self, key: int, loads: Mapping[str, int]) -> str:
        """The first worker clockwise from ``key`` whose load stays within the bound."""
        total = sum(loads.values())
        bound = math.ceil(self.load_factor * (total + 1) / len(loads))
        start = bisect.bisect_left(self._points, xxhash.xxh3_64_intdigest(_U64.pack(key)))
        n = len(self._points)
        for i in range(n):
            wid = self._owners[(start + i) % n]
            if loads.get(wid, 0) + 1 <= bound:
                return wid
        return self._owners[start % n]  # unreachable: the bound always admits someone


class SglangLike:
    """SGLang-style cache-aware routing on the router's own approximate trees."""

    def __init__(
        self,
        worker_ids: Sequence[str],
        *,
        cache_threshold: float = 0.5,
        balance_abs: int = 32,
        balance_rel: float = 1.0001,
        max_tree_blocks: int = 8192,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("--sglang-cache-threshold must be in [0, 1]")
        if max_tree_blocks < 1:
            raise ValueError("--sglang-max-tree-tokens must hold at least one block")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_blocks = max_tree_blocks
        self._trees: dict[str, OrderedDict[Hashable, None]] = {
            wid: OrderedDict() for wid in worker_ids
        }

    def choose(
        self,
        keys: Sequence[Hashable],
        prompt_tokens: int,
        block_size: int,
        loads: Mapping[str, int],
    ) -> tuple[str, str, int]:
        """``(worker, reason, matched_blocks)`` for a request with chain ``keys``."""
        wids = sorted(self._trees)
        lo = min(loads.get(w, 0) for w in wids)
        hi = max(loads.get(w, 0) for w in wids)
        matches = {w: self._match(self._trees[w], keys) for w in wids}
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            wid = min(wids, key=lambda w: loads.get(w, 0))
            reason = "load"
        else:
            best = max(wids, key=lambda w: matches[w])
            rate = matches[best] * block_size / prompt_tokens if prompt_tokens else 0.0
            if rate > self.cache_threshold:
                wid, reason = best, "cache"
            else:
                wid, reason = min(wids, key=lambda w: len(self._trees[w])), "fallback"
        self._insert(self._trees[wid], keys)
        return wid, reason, matches[wid]

    @staticmethod
    def _match(tree: OrderedDict[Hashable, None], keys: Sequence[Hashable]) -> int:
        n = 0
        for key in keys:
            if key not in tree:
                break
            n += 1
        return n

    def _insert(self, tree: OrderedDict[Hashable, None], keys: Sequence[Hashable]) -> None:
        # Tail first, so the LRU end holds leaves and shared prefixes are trimmed last.
        for key in reversed(keys):
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)
