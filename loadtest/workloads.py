"""Workload generators: multi-turn chat and shared-prefix groups (the trace: ``mooncake_trace``).

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

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from contract.hashing import HashSpec, extend_block_hashes
from loadtest.words import ids_to_text, word_ids


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


BURST_PERIOD_S = 20.0
BURST_ON_S = 4.0


def bursty(convs: Sequence[Conversation]) -> list[Conversation]:
    """``convs`` with every arrival of each period moved into the period's first seconds."""
    squeeze = BURST_ON_S / BURST_PERIOD_S
    out = []
    for c in convs:
        period = math.floor(c.start_s / BURST_PERIOD_S) * BURST_PERIOD_S
        out.append(replace(c, start_s=period + (c.start_s - period) * squeeze))
    return out
