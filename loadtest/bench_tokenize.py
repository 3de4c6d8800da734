"""What rendering and tokenizing cost the gateway, path against path, on cold text.

SmolLM2's tokenizer, texts never seen by a cache, the two paths of each pair
timed in alternating order over ``--rounds`` rounds (median per path): the
process's CPU time and the wall time per text.

- ``chat_cold``: bench_overhead's cold ~5k-token 12-turn chat, rendered;
  ``encode_batch`` with character offsets, in pieces (the gateway's path
  before 5 December 2026) against ``ChatTokenizer._encode_releasing_gil``
  (ids only, in pieces; tiktoken's encoder where exact, ``--fast-bpe``).
- ``chat_cold_tiktoken``: the same texts through ``_encode_releasing_gil``
  with HF tokenizers' ``encode_batch_fast`` (``--fast-bpe false``) against
  tiktoken's encoder (``gateway.text.fast_bpe``).
- ``prompt_cold``: a plain 6,000-word prompt (~9k tokens) through the prompt
  cache; its spans path (``encode_batch`` with offsets, then ``remember``
  reading the spans) against its anchors path (pieces cut at a word start
  per anchor, ``remember_at``), the gateway's default encoder on each.
- ``prompt_cold_tiktoken``: the anchors path, HF tokenizers against tiktoken.
- ``template``: the 24-message chat rendered by ``apply_chat_template``
  against ``ChatTokenizer.render`` (the compiled template for plain messages).

    python -m loadtest.bench_tokenize
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.text.prompt_prefix import PromptPlan, PromptPrefixCache, anchor_keys
from gateway.text.tokenizer import ChatTokenizer
from loadtest.bench_overhead import make_bodies
from worker.model.store import resolve_model

_WORDS = ["the", "of", "and", "system", "request", "model", "cache", "token", "router"]
_WORDS += ["worker", "prefix", "hello", "world", "data", "value", "über", "東京", "x.y", "42"]


def _time(fn: Callable[[Any], Any], items: Sequence[Any]) -> tuple[float, float]:
    """(CPU ms, wall ms) per item."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for item in items:
        fn(item)
    n = len(items)
    return (time.process_time() - cpu0) * 1e3 / n, (time.perf_counter() - wall0) * 1e3 / n


def compare(
    before: Callable[[Any], Any], after: Callable[[Any], Any], items: Sequence[Any], rounds: int
) -> dict[str, float]:
    """Both paths over ``items``, alternating which goes first; medians over the rounds."""
    runs: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for r in range(rounds):
        order = (("before", before), ("after", after))
        for name, fn in order if r % 2 == 0 else order[::-1]:
            runs[name].append(_time(fn, items))
    out = {}
    for name, rows in runs.items():
        out[f"{name}_cpu_ms"] = round(statistics.median(c for c, _ in rows), 3)
        out[f"{name}_wall_ms"] = round(statistics.median(w for _, w in rows), 3)
    out["cpu_ratio"] = round(out["after_cpu_ms"] / out["before_cpu_ms"], 3)
    return out


def run(rounds: int, texts: int) -> dict[str, Any]:
    tok = ChatTokenizer(resolve_model("smollm2"))
    hf_only = ChatTokenizer(resolve_model("smollm2"), fast_bpe=False)
    if tok._bpe is None:
        raise RuntimeError("tiktoken's encoder did not load for SmolLM2")
    chats = [json.loads(b)["messages"] for b in make_bodies("chat_6k_cold", texts, seed=3)]
    rendered = [tok.render(m) for m in chats]
    rng = random.Random(0)
    prompts = [f"{i} " + " ".join(rng.choice(_WORDS) for _ in range(6000)) for i in range(texts)]

    def spans_path(text: str) -> None:
        cache, keys = PromptPrefixCache(), anchor_keys(text)
        encoding = tok._encoding_releasing_gil(text, True)
        cache.remember(text, list(encoding.ids), encoding, keys)

    def anchors_path(text: str, tokenizer: ChatTokenizer = tok) -> None:
        cache, keys = PromptPrefixCache(), anchor_keys(text)
        ids, cuts = tokenizer._encode_at_anchors(text, PromptPlan([], 0, keys))
        cache.remember_at(ids, keys, cuts)

    def transformers_render(messages: list[dict[str, str]]) -> None:
        tok.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return {
        "benchmark": "gateway rendering and tokenizing on cold text, path against path",
        "tokens": {
            "chat_cold": len(tok.encode_text(rendered[0])),
            "prompt_cold": len(tok.encode_text(prompts[0], add_special_tokens=True)),
        },
        "chat_cold": compare(
            lambda t: list(tok._encoding_releasing_gil(t, False).ids),
            lambda t: tok._encode_releasing_gil(t),
            rendered,
            rounds,
        ),
        "chat_cold_tiktoken": compare(
            hf_only._encode_releasing_gil, tok._encode_releasing_gil, rendered, rounds
        ),
        "prompt_cold": compare(spans_path, anchors_path, prompts, rounds),
        "prompt_cold_tiktoken": compare(
            lambda t: anchors_path(t, hf_only), anchors_path, prompts, rounds
        ),
        "template": compare(transformers_render, tok.render, chats, rounds),
        "rounds": rounds,
        "cores": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_tokenize", description=__doc__)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--texts", type=int, default=10, help="cold texts per path and round")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.rounds, args.texts), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
