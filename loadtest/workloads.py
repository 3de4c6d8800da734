"""Workload generators: multi-turn chat, shared-prefix groups, and Mooncake trace replay.

Each workload comes in two forms from the same seeded draw:

- ``Conversation`` objects for the HTTP load client (OpenAI chat messages of
  real words, or token ids for ``/v1/completions``), and
- ``RequestShape`` objects for the fleet simulator: prompt/output lengths and
  the chain of block hashes (``contract.hashing``) of each prompt, so the
  simulator sees exactly the prefixes the real requests would share.

Everything is a pure function of its config and seed: the same seed gives the
same words, ids, arrival times and think times on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contract.hashing import HashSpec, block_hash, block_hashes, extend_block_hashes
from loadtest.words import ids_to_text, word_ids

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's hash ids each cover 512 tokens


@dataclass(frozen=True)
class Turn:
    """One user message of a conversation and the scripted answer that follows it."""

    user_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # what the simulator assumes the model answers
    max_tokens: int
    think_s: float = 0.0  # pause after the previous turn's answer before this turn is sent
    prompt_ids: tuple[int, ...] | None = None  # set: send these ids to /v1/completions

    @property
    def user_text(self) -> str:
        return ids_to_text(self.user_ids)

    @property
    def answer_text(self) -> str:
        return ids_to_text(self.answer_ids)


@dataclass(frozen=True)
class Conversation:
    """A user session: a system prompt and turns sent one after another's answer."""

    conv_id: str
    start_s: float
    system_ids: tuple[int, ...]
    turns: tuple[Turn, ...]

    @property
    def system_text(self) -> str:
        return ids_to_text(self.system_ids)

    def messages(self, turn: int, answers: Sequence[str] | None = None) -> list[dict[str, str]]:
        """OpenAI chat messages for ``turn``: system, then each earlier question and answer.

        ``answers`` are the real answers to the earlier turns (the load client
        appends what the model actually said); without them the scripted
        answers are used.
        """
        if not 0 <= turn < len(self.turns):
            raise ValueError(f"turn {turn} out of range for {len(self.turns)} turns")
        msgs = [{"role": "system", "content": self.system_text}] if self.system_ids else []
        for k in range(turn):
            answer = answers[k] if answers is not None else self.turns[k].answer_text
            msgs.append({"role": "user", "content": self.turns[k].user_text})
            msgs.append({"role": "assistant", "content": answer})
        msgs.append({"role": "user", "content": self.turns[turn].user_text})
        return msgs

    def prompt_ids(self, turn: int) -> list[int]:
        """Word-level token ids of ``turn``'s prompt (system, history, question)."""
        if self.turns[turn].prompt_ids is not None:
            return list(self.turns[turn].prompt_ids or ())
        ids = list(self.system_ids)
        for k in range(turn):
            ids += self.turns[k].user_ids
            ids += self.turns[k].answer_ids
        ids += self.turns[turn].user_ids
        return ids


@dataclass(frozen=True)
class RequestShape:
    """One request as the fleet simulator sees it: sizes, block chain, timing."""

    request_id: str
    arrival_s: float  # absolute arrival (ignored while ``after`` is set)
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...]  # chain hashes of the prompt's full blocks
    output_block_keys: tuple[int, ...] = ()  # further full blocks completed by the answer
    session: str | None = None
    turn: int = 0
    after: str | None = None  # this request is sent when that one finishes ...
    think_s: float = 0.0  # ... plus this pause


# -- (a) multi-turn chat ------------------------------------------------------


@dataclass(frozen=True)
class ChatConfig:
    """N users, each a conversation of T turns sharing one system prompt."""

    users: int = 16
    turns: int = 4
    system_tokens: int = 500
    question_tokens: int = 50
    answer_tokens: int = 200
    think_time_s: float = 2.0  # mean of an exponential pause between turns (0 = none)
    arrival_rate: float = 1.0  # new users per second, Poisson
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "turns", "question_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.system_tokens < 0:
            raise ValueError("--system-tokens must be >= 0")
        if self.think_time_s < 0:
            raise ValueError("--think-time-s must be >= 0")
        if not self.arrival_rate > 0:
            raise ValueError("--arrival-rate must be positive")


def chat_workload(cfg: ChatConfig) -> list[Conversation]:
    """The conversations of ``cfg``, deterministic in ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    system = word_ids(rng, cfg.system_tokens)
    t = 0.0
    convs = []
    for u in range(cfg.users):
        if u:
            t += rng.expovariate(cfg.arrival_rate)
        turns = []
        for k in range(cfg.turns):
            think = rng.expovariate(1.0 / cfg.think_time_s) if k and cfg.think_time_s else 0.0
            turns.append(
                Turn(
                    user_ids=word_ids(rng, cfg.question_tokens),
                    answer_ids=word_ids(rng, cfg.answer_tokens),
                    max_tokens=cfg.answer_tokens,
                    think_s=think,
                )
            )
        convs.append(Conversation(f"user{u:04d}", t, system, tuple(turns)))
    return convs


# -- (b) shared-prefix groups ---------------------------------------------------


@dataclass(frozen=True)
class SharedPrefixConfig:
    """G groups x P prompts; prompts of a group share an S-token system prompt.

    With ``zipf`` > 0 the G x P prompts draw their group from a Zipf law
    instead (group g with weight 1 / (g + 1) ** zipf): a few long prefixes are
    hot, most are rare — the traffic where a prefix-threshold router does well.
    """

    groups: int = 8
    prompts_per_group: int = 16
    system_tokens: int = 2000
    question_tokens: int = 100
    output_tokens: int = 32
    arrival_rate: float = 4.0  # prompts per second, Poisson; groups interleaved at random
    seed: int = 0
    zipf: float = 0.0  # 0 = every group has exactly prompts_per_group prompts

    def __post_init__(self) -> None:
        for name in (
            "groups",
            "prompts_per_group",
            "system_tokens",
            "question_tokens",
            "output_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.arrival_rate > 0:
            raise ValueError("--arrival-rate must be positive")
        if self.zipf < 0:
            raise ValueError("--zipf must be >= 0")


def shared_prefix_workload(cfg: SharedPrefixConfig) -> list[Conversation]:
    """Single-turn conversations of ``cfg``, in a seeded random group order."""
    rng = random.Random(cfg.seed)
    systems = [word_ids(rng, cfg.system_tokens) for _ in range(cfg.groups)]
    pairs = [(g, p) for g in range(cfg.groups) for p in range(cfg.prompts_per_group)]
    rng.shuffle(pairs)
    if cfg.zipf > 0:
        weights = [1.0 / (g + 1) ** cfg.zipf for g in range(cfg.groups)]
        drawn = rng.choices(range(cfg.groups), weights, k=len(pairs))
        pairs = [(g, p) for p, g in enumerate(drawn)]
    t = 0.0
    convs = []
    for i, (g, p) in enumerate(pairs):
        if i:
            t += rng.expovariate(cfg.arrival_rate)
        turn = Turn(
            user_ids=word_ids(rng, cfg.question_tokens),
            answer_ids=word_ids(rng, cfg.output_tokens),
            max_tokens=cfg.output_tokens,
        )
        convs.append(Conversation(f"g{g:03d}p{p:04d}", t, systems[g], (turn,)))
    return convs


def synthetic_workload(args: Any) -> list[Conversation]:
    """The chat or shared-prefix workload named by CLI flags (``args.workload`` and friends).

    One place for the flag-to-config mapping that the load client and the
    simulator share.
    """
    if args.workload == "chat":
        return chat_workload(
            ChatConfig(
                users=args.users,
                turns=args.turns,
                system_tokens=args.system_tokens,
                question_tokens=args.question_tokens,
                answer_tokens=args.answer_tokens,
                think_time_s=args.think_time_s,
                arrival_rate=args.arrival_rate,
                seed=args.seed,
            )
        )
    return shared_prefix_workload(
        SharedPrefixConfig(
            groups=args.groups,
            prompts_per_group=args.prompts_per_group,
            system_tokens=args.system_tokens,
            question_tokens=args.question_tokens,
            output_tokens=args.answer_tokens,
            arrival_rate=args.arrival_rate,
            seed=args.seed,
            zipf=getattr(args, "zipf", 0.0),
        )
    )


def conversation_shapes(convs: Sequence[Conversation], spec: HashSpec) -> list[RequestShape]:
    """Simulator shapes of ``convs``: turn k+1 waits for turn k's answer plus think time."""
    shapes = []
    for conv in convs:
        chain: list[int] = []
        ids: list[int] = list(conv.system_ids)
        prev: str | None = None
        for k, turn in enumerate(conv.turns):
            if turn.prompt_ids is not None:
                ids, chain = list(turn.prompt_ids), []
            else:
                ids += turn.user_ids
            chain += extend_block_hashes(chain, ids, spec)
            prompt_chain = tuple(chain)
            prompt_len = len(ids)
            ids += turn.answer_ids
            chain += extend_block_hashes(chain, ids, spec)
            rid = f"{conv.conv_id}-t{k}"
            shapes.append(
                RequestShape(
                    request_id=rid,
                    arrival_s=conv.start_s,
                    prompt_tokens=prompt_len,
                    output_tokens=turn.max_tokens,
                    block_keys=prompt_chain,
                    output_block_keys=tuple(chain[len(prompt_chain) :]),
                    session=conv.conv_id,
                    turn=k,
                    after=prev,
                    think_s=turn.think_s,
                )
            )
            prev = rid
    return shapes


# -- (c) Mooncake trace replay ---------------------------------------------------


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
