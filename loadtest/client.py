"""An asyncio open-loop load client for any OpenAI-compatible endpoint.

Conversations start at their scheduled ``start_s`` whether or not earlier
ones have finished (open loop); inside a conversation, turn k+1 is sent
``think_s`` after turn k's answer arrived, with that real answer appended to
the history. Every request streams (``stream: true`` with usage), and one
``RequestResult`` per request records TTFT, inter-token gaps, end-to-end
latency, prompt and cached tokens (``usage.prompt_tokens_details.cached_tokens``)
and the serving worker (``x-kvroute-worker`` response header).

A turn with ``prompt_ids`` (trace replay) goes to ``/v1/completions`` with the
token ids as its prompt; every other turn goes to ``/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.workloads import Conversation

log = logging.getLogger(__name__)

WORKER_HEADER = "x-kvroute-worker"


@dataclass(frozen=True)
class ClientConfig:
    """Where to send, and how."""

    base_url: str  # e.g. http://127.0.0.1:8000 (the /v1 paths are appended)
    model: str
    api_key: str | None = None
    time_scale: float = 1.0  # multiplies start times and think times
    request_timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True  # a vLLM-style extension, so outputs have the scripted length
    session_header: bool = True  # send X-Session-ID = the conversation id
    max_connections: int = 0  # 0 = unlimited

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.base_url!r}: must start with http:// or https://")
        if not self.time_scale > 0:
            raise ValueError("--time-scale must be positive")
        if not self.request_timeout_s > 0:
            raise ValueError("--request-timeout-s must be positive")


@dataclass
class RequestResult:
    """The measurements of one request (times in seconds from the run's start)."""

    conv_id: str
    turn: int
    sent_s: float
    status: int = 0
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # every x-kvroute-* header
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def _body(
    cfg: ClientConfig, conv: Conversation, turn: int, answers: Sequence[str]
) -> tuple[str, dict[str, Any]]:
    t = conv.turns[turn]
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": t.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if t.prompt_ids is not None:
        body["prompt"] = list(t.prompt_ids)
        return "/v1/completions", body
    body["messages"] = conv.messages(turn, answers)
    return "/v1/chat/completions", body


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        parts.append((delta or {}).get("content") or choice.get("text") or "")
    return "".join(parts)


async def send_one(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    conv: Conversation,
    turn: int,
    answers: Sequence[str],
    t0: float,
) -> RequestResult:
    """Stream one turn of ``conv`` and measure it; failures are recorded, never raised."""
    path, body = _body(cfg, conv, turn, answers)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    if cfg.session_header:
        headers["X-Session-ID"] = conv.conv_id
    start = time.perf_counter()
    res = RequestResult(conv_id=conv.conv_id, turn=turn, sent_s=start - t0)
    last: float | None = None
    pieces: list[str] = []
    try:
        async with session.post(
            cfg.base_url.rstrip("/") + path, json=body, headers=headers
        ) as resp:
            res.status = resp.status
            res.worker = resp.headers.get(WORKER_HEADER)
            res.headers = {
                k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-kvroute-")
            }
            if resp.status != 200:
                res.error = f"http_{resp.status}"
                log.warning(
                    "%s turn %d: HTTP %d %s",
                    conv.conv_id,
                    turn,
                    resp.status,
                    (await resp.text())[:200],
                )
                return res
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = "stream_error"
                    break
                text = _chunk_text(chunk)
                if text:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    pieces.append(text)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        res.error = type(exc).__name__
        log.warning("%s turn %d: %s", conv.conv_id, turn, exc)
    res.e2e_s = time.perf_counter() - start
    res.text = "".join(pieces)
    if res.error is None and res.ttft_s is None:
        res.error = "no_tokens"
    return res


async def _conversation(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    conv: Conversation,
    t0: float,
    out: list[RequestResult],
) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_s * cfg.time_scale - time.perf_counter()))
    answers: list[str] = []
    for k, turn in enumerate(conv.turns):
        if k:
            await asyncio.sleep(turn.think_s * cfg.time_scale)
        res = await send_one(session, cfg, conv, k, answers, t0)
        out.append(res)
        if not res.ok:
            return  # the history is broken: later turns would not be the same conversation
        answers.append(res.text)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keeps the objects that exist now out of garbage collections while a load plays.

    A benchmark's process holds its trace, tokenizers and earlier results: one full
    collection of them paused the client ~100 ms mid-run, and the request it was
    connecting then became a workload's p99 (kvroute's chat, in every run).
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def run_load(conversations: Sequence[Conversation], cfg: ClientConfig) -> list[RequestResult]:
    """Play every conversation open-loop against ``cfg.base_url``; results in completion order."""
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=cfg.max_connections)
    out: list[RequestResult] = []
    with frozen_heap():
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            t0 = time.perf_counter()
            await asyncio.gather(*(_conversation(session, cfg, c, t0, out) for c in conversations))
    return out


def summarize_results(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Headline numbers of a run: latencies, hit rates overall/per turn/per worker, load, errors."""
    from loadtest import stats

    ok = [r for r in results if r.ok]
    per_worker: dict[str, int] = {}
    for r in ok:
        key = r.worker or "?"
        per_worker[key] = per_worker.get(key, 0) + r.prompt_tokens
    end = max((r.sent_s + (r.e2e_s or 0.0) for r in ok), default=0.0)
    start = min((r.sent_s for r in results), default=0.0)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": stats.error_summary(r.error for r in results),
        "ttft_s": stats.latency_summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": stats.latency_summary([g for r in ok for g in r.itl_s]),
        "e2e_s": stats.latency_summary([r.e2e_s for r in ok if r.e2e_s is not None]),
        "hit_rate": stats.hit_rate([r.cached_tokens for r in ok], [r.prompt_tokens for r in ok]),
        "turn_hit_rate": stats.grouped_hit_rate(
            (r.turn, r.cached_tokens, r.prompt_tokens) for r in ok
        ),
        "worker_hit_rate": stats.grouped_hit_rate(
            (r.worker or "?", r.cached_tokens, r.prompt_tokens) for r in ok
        ),
        "load_share": stats.load_share(per_worker),
        "load_cov": stats.coefficient_of_variation(list(per_worker.values())),
        "throughput_rps": stats.throughput(len(ok), start, end),
        "output_tokens_per_s": stats.throughput(sum(r.completion_tokens for r in ok), start, end),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.client --url URL --model M [--workload chat|shared-prefix|trace]``."""
    import argparse
    import sys

    from loadtest.mooncake_trace import load_trace, trace_conversations
    from loadtest.workloads import synthetic_workload

    p = argparse.ArgumentParser(
        prog="python -m loadtest.client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key")
    p.add_argument("--workload", choices=("chat", "shared-prefix", "trace"), default="chat")
    p.add_argument("--trace", help="Mooncake-format JSONL (for --workload trace)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--question-tokens", type=int, default=50)
    p.add_argument("--answer-tokens", type=int, default=200)
    p.add_argument("--think-time-s", type=float, default=2.0)
    p.add_argument("--arrival-rate", type=float, default=1.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = ClientConfig(
            base_url=args.url, model=args.model, api_key=args.api_key, time_scale=args.time_scale
        )
        if args.workload == "trace":
            if not args.trace:
                raise ValueError("--trace is required with --workload trace")
            convs = trace_conversations(load_trace(args.trace, limit=args.limit))
        else:
            convs = synthetic_workload(args)
    except ValueError as exc:
        print(f"client: {exc}", file=sys.stderr)
        return 2
    results = asyncio.run(run_load(convs, cfg))
    summary = summarize_results(results)
    print(json.dumps(summary, indent=None if args.json else 2, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
