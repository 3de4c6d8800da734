"""Gateway routing cost per request, without inference: ``python -m loadtest.bench_gateway``.

For 12-turn chats that grow to ~6k tokens on SmolLM2's tokenizer, times what
the gateway does before it sends a request to a worker: parse the JSON body,
render the chat template, tokenize, hash the blocks, look up the index and
score the workers (the real ``Dispatcher.route`` over an 8-worker in-memory
fleet). Measured twice — with incremental tokenization (earlier turns' ids
reused) and with a full re-tokenization each turn — beside the cost of
tokenizing the whole final prompt. Prints one JSON object.

``plain_prompts``: the same for ``/v1/completions`` text prompts, tokenized
with and without the word-boundary prompt cache (``gateway.text.prompt_prefix``):
the first ``--prompts-limit`` requests of a Mooncake-format trace, each
``hash_id`` standing for ``--words-per-block`` words of text, so prompts share
text exactly where the trace's requests share blocks (as aiperf's
``mooncake_trace`` prompts do). ``ids_identical`` checks the two modes agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from contract.hashing import HashSpec, block_hashes
from contract.redis_layout import RedisLayout, WorkerRecord
from gateway.edge.auth import ANONYMOUS
from gateway.routing.dispatch import Dispatcher
from gateway.routing.index import BlockIndex
from gateway.routing.jobs import Job
from gateway.routing.mirror import IndexMirror
from gateway.routing.mirror_state import WorkerEntry
from gateway.routing.sessions import SessionMap
from gateway.text.prefix_tokens import Prompt
from gateway.text.tokenizer import ChatTokenizer
from gateway.text.tokenizer_folder import resolve_model_dir
from gateway.upstream.grpc_worker import GrpcUpstream
from loadtest.scale_dispatcher import greedy_generation, standalone_dispatcher
from openai_api.requests import parse_chat

_WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "worker",
    "gateway",
    "route",
    "index",
    "hash",
    "chain",
    "model",
    "prompt",
    "session",
    "latency",
    "queue",
    "tenant",
    "stream",
    "event",
    "epoch",
    "mirror",
    "redis",
    "kernel",
    "tensor",
    "attention",
    "layer",
    "decode",
    "prefill",
    "batch",
    "schedule",
    "evict",
    "pin",
    "salt",
]


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() + "." if i % 17 == 16 else w)
    return " ".join(out)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(_pct(ms, 0.5), 4),
        "p99_ms": round(_pct(ms, 0.99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "n": len(ms),
    }


def _dispatcher(spec: HashSpec, workers: int) -> Dispatcher:
    index = BlockIndex()
    mirror = IndexMirror("redis://unused", RedisLayout("bench"), index)
    for i in range(workers):
        wid = f"w{i}"
        record = WorkerRecord(
            worker_id=wid,
            address=f"127.0.0.1:{50000 + i}",
            model=spec.model,
            hash_spec=spec.describe(),
            block_size=spec.block_size,
            num_blocks=20000,
            max_model_len=8192,
            running=i % 3,
            prefill_tokens_per_s=5000.0 + 100 * i,
            updated_at=time.time(),
        )
        mirror.workers[wid] = WorkerEntry(record=record, spec=spec, loaded=True)
        index.add(wid, [])
    return standalone_dispatcher(
        mirror, index, upstreams={"grpc": GrpcUpstream()}, sessions=SessionMap(600.0)
    )


def run(
    model: str, conversations: int, turns: int, words_per_message: int, workers: int, seed: int
) -> dict[str, Any]:
    model_dir = resolve_model_dir(model)
    results: dict[str, Any] = {}
    final_tokens = 0
    whole_ms: list[float] = []
    for mode in ("incremental+answer", "incremental", "full"):
        tok = ChatTokenizer(model_dir, incremental=(mode != "full"))
        spec = HashSpec(block_size=16, model=model_dir.name)
        dispatcher = _dispatcher(spec, workers)
        rng = random.Random(seed)
        per_request: list[float] = []
        last_turn: list[float] = []
        parts = {"parse": [], "render": [], "tokenize": [], "route": []}  # type: dict[str, list[float]]
        for c in range(conversations):
            messages: list[dict[str, str]] = [{"role": "system", "content": _text(rng, 40)}]
            home = f"w{c % workers}"
            for turn in range(turns):
                messages.append({"role": "user", "content": _text(rng, words_per_message)})
                body = json.dumps(
                    {
                        "model": spec.model,
                        "messages": messages,
                        "max_tokens": 64,
                        "user": f"conv-{c}",
                    }
                ).encode()
                t0 = time.perf_counter()
                req = parse_chat(json.loads(body))
                t1 = time.perf_counter()
                text = tok.render(req.messages)
                t2 = time.perf_counter()
                if tok.prefix_cache is not None:
                    prompt = tok.prefix_cache.encode(text, tok.encode_text)
                else:
                    prompt = Prompt(tok.encode_text(text))
                ids = prompt.ids
                t3 = time.perf_counter()
                job = Job(
                    request_id=f"c{c}t{turn}",
                    prompt=prompt,
                    generation=greedy_generation(f"c{c}t{turn}", ids),
                    tenant=ANONYMOUS,
                    session_key=req.sampling.user,
                    started=t0,
                )
                candidates = dispatcher.hash(job, dispatcher.candidates())
                decision = dispatcher.choose(job, candidates, dispatcher.look_up(candidates))
                t4 = time.perf_counter()
                per_request.append((t4 - t0) * 1e3)
                if turn == turns - 1:
                    last_turn.append((t4 - t0) * 1e3)
                for key, dt in (
                    ("parse", t1 - t0),
                    ("render", t2 - t1),
                    ("tokenize", t3 - t2),
                    ("route", t4 - t3),
                ):
                    parts[key].append(dt * 1e3)
                # What the fleet would now hold: this prompt's blocks on the chosen worker
                # (the conversation's home, as a cache-aware fleet converges to).
                dispatcher.index.add(home, block_hashes(ids, spec))
                dispatcher.sessions.put(req.sampling.user, decision.worker_id, time.monotonic())
                answer = _text(rng, words_per_message)
                if mode == "incremental+answer":
                    # What the gateway does after the response went out (not timed).
                    asyncio.run(tok.remember_answer(messages, answer))
                messages.append({"role": "assistant", "content": answer})
                final_tokens = max(final_tokens, len(ids))
                if mode == "full" and turn == turns - 1:
                    t5 = time.perf_counter()
                    tok.encode_text(text)
                    whole_ms.append((time.perf_counter() - t5) * 1e3)
        results[mode] = {
            **_summary(per_request),
            "last_turn": _summary(last_turn),
            "breakdown_p50_ms": {k: round(_pct(v, 0.5), 4) for k, v in parts.items()},
        }
        if tok.prefix_cache is not None:
            results[mode]["prefix_cache_hits"] = tok.prefix_cache.hits
    return {
        "benchmark": "gateway routing time per request (parse + render + tokenize + hash + "
        "lookup + score; no inference)",
        "model": model_dir.name,
        "conversations": conversations,
        "turns": turns,
        "workers": workers,
        "final_prompt_tokens": final_tokens,
        "routing": results,
        "tokenize_whole_final_prompt": _summary(whole_ms),
        "modes": {
            "full": "re-tokenize the whole rendered chat every turn",
            "incremental": "reuse the previous turn's prompt prefix (ids and block hashes)",
            "incremental+answer": "also pre-tokenize each answer after its response is sent "
            "(as the gateway does), so a turn tokenizes only its new "
            "user message",
        },
        "target": "incremental p50 <= 1 ms",
        "target_met": results["incremental+answer"]["p50_ms"] <= 1.0,
        "python": sys.version.split()[0],
    }


def run_prompts(model: str, trace: Path, limit: int, words_per_block: int) -> dict[str, Any]:
    """Tokenizing trace-shaped plain prompts with and without the prompt cache."""
    model_dir = resolve_model_dir(model)
    rows = []
    with trace.open() as f:
        for line in f:
            if len(rows) >= limit:
                break
            rows.append(json.loads(line)["hash_ids"])
    blocks: dict[int, str] = {}

    def block(h: int) -> str:
        if h not in blocks:
            blocks[h] = _text(random.Random(h), words_per_block) + " "
        return blocks[h]

    prompts = ["".join(block(h) for h in ids) for ids in rows]
    out: dict[str, Any] = {}
    ids_by_mode: dict[str, list[list[int]]] = {}
    for mode in ("prompt_cache", "plain"):
        tok = ChatTokenizer(model_dir, incremental=(mode == "prompt_cache"))

        async def tokenize_all(tok: ChatTokenizer = tok) -> tuple[list[float], list[list[int]]]:
            ms, ids = [], []
            for text in prompts:
                t0 = time.perf_counter()
                prompt = await tok.aencode_prompt(text)
                ms.append((time.perf_counter() - t0) * 1e3)
                ids.append(prompt.ids)
            return ms, ids

        ms, ids_by_mode[mode] = asyncio.run(tokenize_all())
        out[mode] = {**_summary(ms), "mean_ms": round(statistics.fmean(ms), 4)}
        cache = tok.prompt_cache
        if cache is not None:
            total = sum(len(i) for i in ids_by_mode[mode])
            out[mode]["reused_token_fraction"] = round(cache.reused_tokens / total, 4)
            out[mode]["hits"] = cache.hits
    seen: set[int] = set()
    shared = total_blocks = 0
    for ids in rows:
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        shared += k
        total_blocks += len(ids)
        seen.update(ids)
    return {
        "trace": trace.name,
        "requests": len(rows),
        "words_per_block": words_per_block,
        "mean_prompt_tokens": round(
            statistics.fmean(len(i) for i in ids_by_mode["plain"]) if rows else 0.0, 1
        ),
        "trace_prefix_block_fraction": round(shared / max(total_blocks, 1), 4),
        **out,
        "mean_speedup": round(out["plain"]["mean_ms"] / out["prompt_cache"]["mean_ms"], 3),
        "ids_identical": ids_by_mode["plain"] == ids_by_mode["prompt_cache"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_gateway", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="smollm2", help="model folder or the alias smollm2 (tokenizer only)"
    )
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument(
        "--words-per-message",
        type=int,
        default=200,
        help="~1.2 tokens per word: 200 words x 24 messages is ~6k tokens",
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--prompts-trace",
        type=Path,
        default=Path(__file__).parent / "traces" / "mooncake_conversation_trace.jsonl",
    )
    parser.add_argument("--prompts-limit", type=int, default=1000, help="0: skip plain prompts")
    parser.add_argument("--words-per-block", type=int, default=40)
    args = parser.parse_args(argv)
    result = run(
        args.model, args.conversations, args.turns, args.words_per_message, args.workers, args.seed
    )
    if args.prompts_limit > 0:
        result["plain_prompts"] = run_prompts(
            args.model, args.prompts_trace, args.prompts_limit, args.words_per_block
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
