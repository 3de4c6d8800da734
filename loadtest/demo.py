"""``make demo``: a local fleet with a real model and a multi-turn chat through the gateway.

Starts a private Redis (unless ``KVROUTE_REDIS_URL`` is set), two workers serving
SmolLM2-135M-Instruct on the CPU and the gateway on 127.0.0.1:8000, then plays
a scripted 4-turn conversation and a second conversation through the official
``openai`` client, printing per turn which worker served it, ``cached_tokens``
and TTFT, and finally per-worker hit rates and the dashboard URL. The fleet
stays up for the dashboard until Ctrl-C (or exits at once with ``--exit``).
Each process logs to ``.demo-logs/<name>.log``; a process that dies early is
reported with the last lines of its log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from loadtest.fleet import Fleet, FleetConfig, sigterm_as_ctrl_c

SYSTEM = (
    "You are kvroute's demo assistant. Answer briefly and precisely. You help engineers who run "
    "fleets of large language model servers understand prefix caching: every request's prompt is "
    "split into blocks of sixteen tokens, each block is hashed together with the block before it, "
    "and a worker that already holds the first blocks of a prompt skips recomputing them."
)
CONVERSATIONS = {
    "alice": [
        "What is a KV cache, in one sentence?",
        "Why does a multi-turn chat benefit from prefix caching?",
        "What happens when a worker runs out of cache blocks?",
        "Summarize our conversation in one line.",
    ],
    "bob": [
        "Name three things a router can use to pick a worker.",
        "Which of those matters most for long prompts?",
    ],
}


@dataclass
class Turn:
    user: str
    turn: int
    worker: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def chat_turn(client, model: str, messages: list[dict], user: str) -> tuple[str, Turn]:
    """One streamed chat request; returns the answer text and its measurements."""
    start = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        user=user,
        extra_headers={"X-Session-ID": user},
    )
    first: float | None = None
    text, usage = [], None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    turn = Turn(
        user=user,
        turn=len(messages) // 2,
        worker=raw.headers.get("x-kvroute-worker", "?"),
        reason=raw.headers.get("x-kvroute-reason", "?"),
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens=cached,
        ttft_s=(first or time.perf_counter()) - start,
    )
    return "".join(text), turn


def play(base_url: str, model: str) -> list[Turn]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="demo")
    turns: list[Turn] = []
    histories = {user: [{"role": "system", "content": SYSTEM}] for user in CONVERSATIONS}
    print(
        f"{'user':<6} {'turn':>4}  {'worker':<10} {'reason':<8} {'prompt':>6} {'cached':>6} "
        f"{'ttft':>7}  answer"
    )
    for index in range(max(len(q) for q in CONVERSATIONS.values())):
        for user, questions in CONVERSATIONS.items():
            if index >= len(questions):
                continue
            history = histories[user]
            history.append({"role": "user", "content": questions[index]})
            answer, turn = chat_turn(client, model, history, user)
            history.append({"role": "assistant", "content": answer})
            turns.append(turn)
            print(
                f"{user:<6} {index + 1:>4}  {turn.worker:<10} {turn.reason:<8} "
                f"{turn.prompt_tokens:>6} {turn.cached_tokens:>6} {turn.ttft_s * 1000:>5.0f}ms"
                f"  {answer.strip()[:60]!r}"
            )
    return turns


def summarize(turns: list[Turn]) -> None:
    prompt: dict[str, int] = defaultdict(int)
    cached: dict[str, int] = defaultdict(int)
    for turn in turns:
        prompt[turn.worker] += turn.prompt_tokens
        cached[turn.worker] += turn.cached_tokens
    print("\nper-worker token hit rate (cached prompt tokens / prompt tokens):")
    for worker in sorted(prompt):
        rate = cached[worker] / prompt[worker] if prompt[worker] else 0.0
        print(f"  {worker:<10} {rate:6.1%}  ({cached[worker]}/{prompt[worker]})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--exit", action="store_true", help="stop right after the conversations")
    args = parser.parse_args(argv)
    config = FleetConfig(
        model=args.model,
        workers=args.workers,
        gateway_port=args.port,
        redis_url=os.environ.get("KVROUTE_REDIS_URL", ""),
        log_dir=".demo-logs",
    )
    print(
        f"starting Redis, {args.workers} workers ({args.model}) and the gateway "
        f"(logs in {config.log_dir}/) ...",
        flush=True,
    )
    try:
        with sigterm_as_ctrl_c():  # `docker stop` or `kill` stops the fleet as Ctrl-C does
            return run(config, args.exit)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


def run(config: FleetConfig, exit_at_once: bool) -> int:
    """Plays the conversations on a fresh fleet; keeps it up until Ctrl-C unless told not to."""
    with Fleet(config) as fleet:
        served = fleet_model_name(fleet.gateway_url)
        print(f"gateway {fleet.gateway_url} serves {served!r}\n")
        summarize(play(fleet.gateway_url, served))
        print(f"\ndashboard: {fleet.gateway_url}/dashboard   metrics: {fleet.gateway_url}/metrics")
        if not exit_at_once:
            print("fleet is up; Ctrl-C stops everything")
            with contextlib.suppress(KeyboardInterrupt):
                while all(w.proc.poll() is None for w in fleet.workers):
                    time.sleep(0.5)
    print("stopped")
    return 0


def fleet_model_name(base_url: str) -> str:
    """The model id the gateway serves (first entry of /v1/models)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


if __name__ == "__main__":
    raise SystemExit(main())
