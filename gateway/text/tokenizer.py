"""The model's own tokenizer and chat template, as the gateway uses them.

``apply_chat_template(messages, add_generation_prompt=True)`` rendered to text
and encoded without extra special tokens gives exactly the ids the worker
computes, so the gateway's block hashes match the worker's. Multi-turn chats
reuse the ids of earlier turns (``gateway.text.prefix_tokens``), plain prompts
those of text shared with earlier prompts (``gateway.text.prompt_prefix``).
Ids come from tiktoken's encoder where it reproduces the tokenizer exactly
(``gateway.text.fast_bpe``: a fifth of the CPU), else from the Rust
tokenizer's batch calls. A long uncached suffix is tokenized on an executor
thread; both encoders release the GIL there (plain ``encode`` of the Rust
tokenizer holds it for the whole call: measured, a 5 s encode on a thread
left the loop one tick), so the event loop keeps serving meanwhile. With the
Rust tokenizer a suffix of twice ``PARALLEL_MIN_CHARS`` or more goes in
pieces cut before words (``prompt_prefix.split_at_word_starts``), which
``encode_batch`` encodes on every core at once; only for a tokenizer whose
ids split there (checked on probe texts at start-up).
Transformers' tokenizers work without torch; this module never imports it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from gateway.text.chat_template import PROBE_CHAT, DirectTemplate
from gateway.text.fast_bpe import FastBpe
from gateway.text.prefix_tokens import PrefixTokenCache, Prompt
from gateway.text.prompt_prefix import (
    ANCHOR_CHARS,
    JoinedSpans,
    PromptPlan,
    PromptPrefixCache,
    anchor_word_starts,
    ids_before,
    is_cut,
    is_word_start,
    split_at_word_starts,
)

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096
# Uncached text this long is tokenized on an executor thread: about 1 ms of encoding
# with either encoder (HF tokenizers ~0.2 us a character, tiktoken's ~0.04). Shorter
# text stays on the loop: under load a thread's encode waits for the GIL, and a cold
# 7k-token prompt's 1.5 ms encode took 11-28 ms (wall) on the executor.
EXECUTOR_MIN_CHARS_HF = 4096
EXECUTOR_MIN_CHARS_FAST_BPE = 32768
# Long suffixes are encoded in pieces of at least this many characters, at most one per
# core: a 26k-character text took 5.9 ms whole and 2.7 ms in two pieces on 2 idle cores.
PARALLEL_MIN_CHARS = 8192
# Probe conversation for finding the message marker and checking the split identity
# (``chat_template.PROBE_CHAT``, which also checks the direct template render).
_PROBE = PROBE_CHAT
# Probe text for the word-boundary split identity of plain prompts: prose, code, digits,
# contractions, doubled spaces and tabs, accents, CJK, emoji and markup next to the cuts.
_PROMPT_PROBE = (
    "The quick brown fox's den isn't far.\nIt jumped  over 12,345 lazy dogs; "
    "naïve café owners said: 'hello world' again.\n\ndef main(x):\n    return x * 2  # ok\n"
    "Über straße 東京 is big \tTab here.\r\nWindows line\nπ ≈ 3.14159 and émigré "
    "résumé 😀 smile <b>bold</b> text.\n- item one\n- item two\n1. first\n"
    "URL http://example.com/a b c?x=1&y=2 end.\n\n\n  Indented line\n\tTabbed line\nLast"
)


def _max_model_len(model_dir: Path, tokenizer: Any) -> int:
    config = model_dir / "config.json"
    if config.exists():
        try:
            data = json.loads(config.read_text())
            for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
                if isinstance(data.get(key), int) and data[key] > 0:
                    return int(data[key])
        except (OSError, ValueError) as exc:
            logger.warning("could not read %s: %s", config, exc)
    limit = getattr(tokenizer, "model_max_length", 0)
    return int(limit) if isinstance(limit, int) and 0 < limit < 10**7 else _DEFAULT_MAX_MODEL_LEN


class ChatTokenizer:
    """Renders, encodes and (via ``openai_api.detokenizer``) decodes for one model."""

    def __init__(
        self,
        model_dir: Path,
        *,
        cache_entries: int = 1024,
        cache_tokens: int = 8_000_000,
        executor_min_chars: int = 0,
        incremental: bool = True,
        fast_bpe: bool = True,
    ) -> None:
        from transformers import AutoTokenizer  # heavy: imported only when a gateway starts

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.max_model_len = _max_model_len(self.model_dir, self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        # The Rust tokenizer directly: a third of the Python wrapper's per-call overhead.
        self._fast = getattr(self.tokenizer, "_tokenizer", None)
        # Ids without character offsets where the library can (``encode_batch_fast``):
        # 25-30 % less CPU (130 against 172 us on a 130-word message, 4.7 against
        # 6.8 ms on a 5k-token chat); a batch call also releases the GIL.
        self._batch_ids: Any = (
            getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)
            if self._fast is not None
            else None
        )
        # Plain messages skip apply_chat_template's per-call preparation (same text).
        self._direct = (
            DirectTemplate.load(self.tokenizer)
            if getattr(self.tokenizer, "chat_template", None)
            else None
        )
        # Whether encoding adds special tokens (a BOS): pieces of such a prompt go whole.
        self._adds_special_tokens = self._fast is not None and (
            self._fast.encode("a", add_special_tokens=True).ids
            != self._fast.encode("a", add_special_tokens=False).ids
        )
        # Ids from tiktoken's encoder where it gives exactly HF's (``fast_bpe``): 5x less CPU.
        self._bpe: FastBpe | None = None
        if fast_bpe and self._fast is not None:
            self._bpe = self._load_fast_bpe()
        # 0 = by encoder (EXECUTOR_MIN_CHARS_*).
        auto = EXECUTOR_MIN_CHARS_HF if self._bpe is None else EXECUTOR_MIN_CHARS_FAST_BPE
        self.executor_min_chars = executor_min_chars or auto
        self.prefix_cache: PrefixTokenCache | None = None
        if incremental and getattr(self.tokenizer, "chat_template", None):
            self.prefix_cache = self._build_prefix_cache(cache_entries, cache_tokens)
        # (prompt, answer) digests already pre-tokenized for a next turn (``answer_is_new``).
        self._answers_seen: OrderedDict[int, None] = OrderedDict()
        self._answers_seen_max = cache_entries
        self.prompt_cache: PromptPrefixCache | None = None
        # Long texts are encoded in pieces when ids split before every word.
        self.splits_at_word_starts = self._fast is not None and self._pieces_join_up()
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        if incremental and self._fast is not None and self._splits_at_word_cuts():
            self.prompt_cache = PromptPrefixCache(
                max_entries=cache_entries, max_tokens=cache_tokens
            )
        logger.info(
            "tokenizer %s: vocab %d, max_model_len %d, incremental chats %s, prompts %s, "
            "tiktoken's encoder %s",
            self.model_dir,
            self.vocab_size,
            self.max_model_len,
            self.prefix_cache is not None,
            self.prompt_cache is not None,
            self._bpe is not None,
        )

    # -- rendering and encoding ---------------------------------------------------

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template applied to ``messages``, ending with the assistant's prompt.

        ``template_kwargs`` are a request's ``chat_template_kwargs`` (e.g. Qwen3's
        ``enable_thinking``), passed to the template exactly as a worker passes them.
        """
        if self._direct is not None:
            direct = self._direct.render(
                messages, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
            if direct is not None:
                return direct
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        if not isinstance(text, str):
            raise ValueError("the chat template did not render to text")
        return text

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (no caching)."""
        if self._fast is not None:
            return self._ids_of([text], add_special_tokens)[0]
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def aencode_rendered(self, text: str, *, remember_below: int | None = None) -> Prompt:
        """Ids of an already rendered chat; a long uncached suffix goes to an executor.

        The prefixes are remembered only when the prompt has fewer than
        ``remember_below`` tokens (one the context refuses never fills the cache).
        """
        cache = self.prefix_cache
        if cache is None:
            return Prompt(await self._encode_maybe_off_loop(text), text=text)
        plan = cache.plan(text)
        ids = plan.prefix_ids + await self._encode_maybe_off_loop(text[plan.cut :])
        if remember_below is not None and len(ids) >= remember_below:
            return Prompt(ids, plan.entry, text=text)
        return Prompt(ids, plan.entry, cache.remember(text, ids), text)

    async def aencode_prompt(self, text: str, *, remember_below: int | None = None) -> Prompt:
        """Ids of a plain completion prompt (the tokenizer's own special tokens added).

        A prompt sharing text with a remembered one reuses that prefix's ids up
        to a word-boundary cut (``gateway.text.prompt_prefix``); the prompt is
        then remembered if it has fewer than ``remember_below`` tokens.
        """
        cache = self.prompt_cache
        if cache is None or len(text) < ANCHOR_CHARS:
            return Prompt(await self._encode_maybe_off_loop(text, add_special_tokens=True))
        plan = cache.plan(text)
        if self.splits_at_word_starts and not (plan.cut == 0 and self._adds_special_tokens):
            if len(text) - plan.cut >= self.executor_min_chars:
                loop = asyncio.get_running_loop()
                ids, cuts = await loop.run_in_executor(None, self._encode_at_anchors, text, plan)
            else:
                ids, cuts = self._encode_at_anchors(text, plan)
            if remember_below is None or len(ids) < remember_below:
                cache.remember_at(ids, plan.keys, cuts)
            return Prompt(ids)
        tail = text[plan.cut :]
        encoding = await self._encoding_maybe_off_loop(tail, add_special_tokens=not plan.cut)
        ids = plan.prefix_ids + list(encoding.ids)
        if remember_below is None or len(ids) < remember_below:
            cache.remember(text, ids, encoding, plan.keys, shift=plan.cut)
        return Prompt(ids)

    def _encode_at_anchors(
        self, text: str, plan: PromptPlan
    ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """The prompt's ids, its tail encoded in pieces cut at a word start per anchor.

        Where ids split at word starts, each cut's token count is the ids of the
        pieces before it, so no character offsets are needed (``encode_batch_fast``)
        and the pieces are encoded on every core in one call: a 6k-token prompt
        took 6.5-7.2 ms CPU against 7.7-8.8 with offsets in two pieces. Returns
        the ids and, per anchor cut, (anchor index, ids before it, the cut).
        """
        cuts = anchor_word_starts(text, plan.cut, len(plan.keys))
        bounds = [plan.cut, *(p for _, p in cuts), len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        encodings = self._ids_of(pieces)
        ids = list(plan.prefix_ids)
        counted: list[tuple[int, int, int]] = []
        for (k, p), piece_ids in zip(cuts, encodings, strict=False):
            ids += piece_ids
            counted.append((k, len(ids), p))
        ids += encodings[-1]
        return ids, counted

    def _ids_of(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's ids: tiktoken's encoder where it is exact, else HF's batch call."""
        if self._bpe is not None and not (add_special_tokens and self._adds_special_tokens):
            fast = self._bpe.encode_many(texts)
            if fast is not None:
                return fast
        return self._hf_ids(texts, add_special_tokens)

    def _hf_ids(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's ids from the Rust tokenizer's batch call (ids only)."""
        return [e.ids for e in self._batch_ids(texts, add_special_tokens=add_special_tokens)]

    async def _encode_maybe_off_loop(
        self, text: str, *, add_special_tokens: bool = False
    ) -> list[int]:
        if len(text) >= self.executor_min_chars:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                None, self._encode_releasing_gil, text, add_special_tokens
            )
        return self.encode_text(text, add_special_tokens=add_special_tokens)

    async def _encoding_maybe_off_loop(self, text: str, *, add_special_tokens: bool) -> Any:
        """The Rust tokenizer's ``Encoding`` (ids and offsets); long texts on an executor."""
        assert self._fast is not None  # the prompt cache exists only with a fast tokenizer
        if len(text) >= self.executor_min_chars:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                None, self._encoding_releasing_gil, text, add_special_tokens
            )
        return self._fast.encode(text, add_special_tokens=add_special_tokens)

    def answer_is_new(self, prompt: Prompt, answer: str) -> bool:
        """False when this chat already got this answer lately (and it was remembered).

        A conversation resent with the same answer (a retry, an eval's repeated prompt,
        ``loadtest.bench_overhead``'s ``chat_6k_repeat``) then re-renders its whole
        history for ``remember_answer`` once, not per request: that render was 10.8 %
        of a gateway's CPU on ``chat_6k_repeat``. The digest is of the rendered text,
        which determines the ids: 2 us on a 6k-token chat, against 30 for its ids.
        """
        if self.prefix_cache is None or prompt.text is None:
            return False
        key = xxhash.xxh3_128_intdigest(
            (prompt.text + "\0" + answer).encode("utf-8", "surrogatepass")
        )
        seen = self._answers_seen
        if key in seen:
            seen.move_to_end(key)
            return False
        seen[key] = None
        if len(seen) > self._answers_seen_max:
            seen.popitem(last=False)
        return True

    async def remember_answer(self, messages: Sequence[Mapping[str, Any]], answer: str) -> None:
        """Pre-tokenizes the chat as the client's next turn will resend it.

        Called after a response went out. The history plus this answer is
        rendered followed by a placeholder user message (templates such as
        Qwen3's render a final assistant message differently from one in the
        middle); the text before that user message's marker is exactly a
        prefix of the next turn's text, so that turn tokenizes only its new
        message. A client that edits the answer just misses this entry.
        """
        cache = self.prefix_cache
        if cache is None:
            return
        history = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": ""},
        ]
        try:
            text = self.render(history)
        except Exception as exc:  # a template may refuse the placeholder message
            logger.debug("not pre-tokenizing an answer: %s", exc)
            return
        gen = text.rfind(cache.marker)
        user = text.rfind(cache.marker, 0, gen)
        if user <= 0:
            return
        prefix = text[: user + len(cache.marker)]
        plan = cache.plan(prefix)
        ids = plan.prefix_ids + await self._encode_maybe_off_loop(prefix[plan.cut :])
        prompt = Prompt(ids, plan.entry, cache.remember(prefix, ids))
        # Extend the block-hash chains too, so the next turn hashes only its new blocks.
        for spec in list(plan.entry.chains) if plan.entry is not None else []:
            prompt.block_hashes(spec)

    def _encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``encode_text`` for an executor thread: batch calls let the loop run meanwhile."""
        if self._fast is None or self._bpe is not None:  # tiktoken: no gain from pieces
            return self.encode_text(text, add_special_tokens=add_special_tokens)
        texts = self._pieces(text, add_special_tokens)
        if len(texts) == 1:
            return self.encode_text(text, add_special_tokens=add_special_tokens)
        ids: list[int] = []
        for piece in self._ids_of(texts):
            ids += piece
        return ids

    def _encoding_releasing_gil(self, text: str, add_special_tokens: bool) -> Any:
        """Ids and spans of ``text`` through ``encode_batch``, which releases the GIL.

        A text in pieces (``_pieces``) comes back as a ``JoinedSpans``.
        """
        assert self._fast is not None
        texts = self._pieces(text, add_special_tokens)
        if len(texts) == 1:
            return self._fast.encode_batch(texts, add_special_tokens=add_special_tokens)[0]
        return JoinedSpans(self._fast.encode_batch(texts, add_special_tokens=False), texts)

    def _pieces(self, text: str, add_special_tokens: bool) -> list[str]:
        """``text`` cut before words into one piece per core (batch calls encode them in
        parallel) when it is long, ids split there and the pieces need no special tokens
        of their own; else ``[text]``."""
        parts = min(self._cores, len(text) // PARALLEL_MIN_CHARS)
        specials_needed = add_special_tokens and self._adds_special_tokens
        if parts > 1 and self.splits_at_word_starts and not specials_needed:
            return split_at_word_starts(text, parts)
        return [text]

    # -- incremental set-up ---------------------------------------------------------

    def _load_fast_bpe(self) -> FastBpe | None:
        """tiktoken's encoder for this vocabulary, if it gives HF's ids on the probes."""
        return FastBpe.load(self.model_dir / "tokenizer.json", self._hf_ids, self._probe_texts())

    def _probe_texts(self) -> list[str]:
        """The plain probe text, and the probe chat rendered where the template takes it."""
        texts = [_PROMPT_PROBE]
        if getattr(self.tokenizer, "chat_template", None):
            try:
                texts.append(self.render(_PROBE))
            except Exception as exc:  # a template may refuse the probe's roles
                logger.debug("no chat probe text: %s", exc)
        return texts

    def _build_prefix_cache(self, entries: int, tokens: int) -> PrefixTokenCache | None:
        """A prefix cache keyed on the message marker, if this tokenizer allows one."""
        try:
            marker = self._find_marker()
        except ValueError as exc:
            logger.info("incremental tokenization off: %s", exc)
            return None
        marker_id = self.tokenizer.convert_tokens_to_ids(marker)
        if not isinstance(marker_id, int):
            return None
        cache = PrefixTokenCache(marker, marker_id, max_entries=entries, max_tokens=tokens)
        # Self-check on the probe: every marker-aligned split must reproduce the full ids.
        text = self.render(_PROBE)
        full = self.encode_text(text)
        p = text.find(marker, 1)
        while p > 0:
            if self.encode_text(text[:p]) + self.encode_text(text[p:]) != full:
                logger.info("incremental tokenization off: %r does not split cleanly", marker)
                return None
            p = text.find(marker, p + 1)
        return cache

    def _splits_at_word_cuts(self) -> bool:
        """Whether ids of plain text split at every word-boundary cut of the probe text."""
        assert self._fast is not None
        full = self._fast.encode(_PROMPT_PROBE, add_special_tokens=True)
        ids = list(full.ids)
        checked = 0
        for p in range(1, len(_PROMPT_PROBE)):
            if not is_cut(_PROMPT_PROBE, p):
                continue
            n = ids_before(full, p)  # exactly as the cache finds the ids before a cut
            if n is None or ids[:n] + self.encode_text(_PROMPT_PROBE[p:]) != ids:
                logger.info("incremental prompts off: ids do not split at character %d", p)
                return False
            checked += 1
        return checked > 0

    def _pieces_join_up(self) -> bool:
        """Whether the ids of the probe texts, cut before any word, are those of the whole."""
        assert self._fast is not None
        for text in self._probe_texts():
            whole = self.encode_text(text)
            for p in range(1, len(text)):
                if is_word_start(text, p) and (
                    self.encode_text(text[:p]) + self.encode_text(text[p:]) != whole
                ):
                    logger.info("long texts encoded whole: ids do not split at character %d", p)
                    return False
        return True

    def _find_marker(self) -> str:
        """The special token that opens the generation prompt (and so every message)."""
        one = self.render(_PROBE[:2])
        two = self.render(_PROBE[:3])
        specials = {str(t) for t in self.tokenizer.all_special_tokens} | set(self._added_special())
        found = [(one.rfind(s), -len(s), s) for s in specials if s and one.rfind(s) > 0]
        if not found:
            raise ValueError("the template renders no special token")
        last, _, marker = max(found)
        # The next message must start exactly where the generation prompt started.
        if not two.startswith(one[:last]) or not two[last:].startswith(marker):
            raise ValueError(f"{marker!r} does not open each message")
        return marker

    def _added_special(self) -> list[str]:
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return [tok.content for tok in decoder.values() if getattr(tok, "special", False)]
