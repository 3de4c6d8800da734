"""Mooncake trace replay: the trace's records as load-client conversations or simulator shapes.

A Mooncake-format trace gives each request's arrival, input and output length
and the hash ids of its 512-token blocks. ``TraceTokens`` turns each hash id
into a fixed pseudo-random block of token ids, ``TraceChains`` computes the
block-hash chains of the prompts under a ``HashSpec`` (once per distinct
block), and ``trace_conversations`` makes one single-turn ``/v1/completions``
conversation per record. Same seed, same ids on every machine.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from contract.hashing import HashSpec, block_hash, block_hashes
from loadtest.workloads import Conversation, RequestShape, Turn

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's hash ids each cover 512 tokens


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake-format trace."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(
    path: Path | str, *, limit: int | None = None, time_scale: float = 1.0
) -> list[TraceRecord]:
    """The first ``limit`` records of a JSONL trace, arrival times multiplied by ``time_scale``.

    ``time_scale`` 0.5 replays the trace twice as fast (double the arrival
    rate); timestamps are milliseconds in the file.
    """
    if not time_scale > 0:
        raise ValueError("--time-scale must be positive")
    if limit is not None and limit < 1:
        raise ValueError("--limit must be >= 1")
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(
                TraceRecord(
                    arrival_s=row["timestamp"] / 1000.0 * time_scale,
                    input_length=int(row["input_length"]),
                    output_length=int(row["output_length"]),
                    hash_ids=tuple(int(h) for h in row["hash_ids"]),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    return out


# How a replay times the trace's requests: as recorded, or ``spread_times``.
TRACE_ARRIVALS = ("recorded", "spread")


def spread_times(times: Sequence[float]) -> list[float]:
    """Arrival times (sorted) with the ones that share an instant spread evenly over the
    gap to the next instant, in order; the last instant takes the median gap.

    The Mooncake conversation trace's timestamps are quantised: its 12,031
    requests fall on 1,180 instants 3 s apart, about ten at each. Replayed as
    recorded, every instant is a burst of simultaneous requests, which a single
    gateway routes one by one, each seeing the last, while gateway replicas
    route their shares at once, none seeing the others'. Spread, the same
    requests arrive in the same order at the same mean rate.
    """
    if not times:
        return []
    instants = sorted(set(times))
    gaps = [b - a for a, b in itertools.pairwise(instants)]
    last_gap = statistics.median(gaps) if gaps else 0.0
    next_instant = dict(zip(instants, [*instants[1:], instants[-1] + last_gap], strict=True))
    at_instant = Counter(times)
    seen: Counter[float] = Counter()
    out = []
    for t in times:
        width = next_instant[t] - t
        out.append(t + width * seen[t] / at_instant[t])
        seen[t] += 1
    return out


def spread_arrivals(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """``records`` with their arrivals spread as ``spread_times`` does."""
    times = spread_times([r.arrival_s for r in records])
    return [replace(r, arrival_s=t) for r, t in zip(records, times, strict=True)]


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) & _MASK64


@dataclass(frozen=True)
class TraceTokens:
    """Maps each trace hash id to a fixed pseudo-random block of token ids.

    The same id always gives the same ``block_tokens`` ids, so prompts that
    share hash ids in the trace share token prefixes. Ids are drawn from
    ``[low_id, vocab_size)`` to stay clear of special tokens.
    """

    vocab_size: int = 32000
    low_id: int = 1000
    seed: int = 0
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not 0 <= self.low_id < self.vocab_size:
            raise ValueError("--vocab-size must exceed the lowest token id used")

    def block(self, hash_id: int) -> np.ndarray:
        """The ``block_tokens`` token ids of trace block ``hash_id`` (int64)."""
        return self.blocks([hash_id])[0]

    def blocks(self, hash_ids: Sequence[int]) -> np.ndarray:
        """Token ids of several trace blocks, shape ``[len(hash_ids), block_tokens]``."""
        with np.errstate(over="ignore"):
            ids = np.asarray(hash_ids, dtype=np.uint64)[:, None]
            pos = np.arange(self.block_tokens, dtype=np.uint64)[None, :]
            seed = _mix64(np.asarray([self.seed], dtype=np.uint64))
            key = _mix64(ids * np.uint64(self.block_tokens) + pos + seed)
        span = np.uint64(self.vocab_size - self.low_id)
        return (key % span).astype(np.int64) + self.low_id

    def prompt_ids(self, record: TraceRecord) -> np.ndarray:
        """The prompt of ``record``: its blocks concatenated, the last cut to ``input_length``."""
        return self.blocks(record.hash_ids).reshape(-1)[: record.input_length]


class TraceChains:
    """Block-hash chains of trace prompts under a ``HashSpec``, computed once per block.

    A trace hash id names a whole prefix, so the hash of every engine block
    that ends inside trace block ``h`` is a function of ``h`` (and the block
    size) alone: it is memoised, and the 12k-request trace hashes each of its
    distinct blocks once. The hashes are exactly ``block_hashes(prompt_ids)``.
    """

    def __init__(self, spec: HashSpec, tokens: TraceTokens | None = None) -> None:
        self.spec = spec
        self.tokens = tokens or TraceTokens()
        self._memo: dict[int, tuple[int, ...]] = {}  # trace id -> hashes of blocks ending in it

    def chain(self, record: TraceRecord) -> list[int]:
        """``block_hashes(tokens.prompt_ids(record), spec)``, memoised per trace block."""
        bs, tb = self.spec.block_size, self.tokens.block_tokens
        if tb % bs:
            return block_hashes(self.tokens.prompt_ids(record), self.spec)
        per = tb // bs
        n_full = record.input_length // bs
        used = record.hash_ids[: -(-n_full // per)]
        # Token ids of every trace block not yet hashed, drawn in one vectorised call.
        fresh = [h for h in used if len(self._memo.get(h, ())) < per]
        drawn = dict(zip(fresh, self.tokens.blocks(fresh), strict=True)) if fresh else {}
        out: list[int] = []
        for hid in used:
            done = self._memo.get(hid)
            if done is None or (len(done) < per and len(out) + len(done) < n_full):
                # First sight, or seen only as a shorter partial last block.
                ids = drawn[hid]
                parent = out[-1] if out else self.spec.seed
                hashes = []
                for j in range(min(per, n_full - len(out))):
                    parent = block_hash(parent, ids[j * bs : (j + 1) * bs], self.spec)
                    hashes.append(parent)
                done = tuple(hashes)
                self._memo[hid] = done
            out += done[: n_full - len(out)]
        return out

    def shapes(self, records: Sequence[TraceRecord]) -> Iterator[RequestShape]:
        """One simulator shape per record, in file order."""
        for i, rec in enumerate(records):
            yield RequestShape(
                request_id=f"r{i:06d}",
                arrival_s=rec.arrival_s,
                prompt_tokens=rec.input_length,
                output_tokens=rec.output_length,
                block_keys=tuple(self.chain(rec)),
            )


def trace_conversations(
    records: Sequence[TraceRecord], tokens: TraceTokens | None = None
) -> list[Conversation]:
    """Trace records as single-turn token-id requests for the load client."""
    tokens = tokens or TraceTokens()
    convs = []
    for i, rec in enumerate(records):
        turn = Turn(
            user_ids=(),
            answer_ids=(),
            max_tokens=rec.output_length,
            prompt_ids=tuple(int(t) for t in tokens.prompt_ids(rec)),
        )
        convs.append(Conversation(f"r{i:06d}", rec.arrival_s, (), (turn,)))
    return convs
