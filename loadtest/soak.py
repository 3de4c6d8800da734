"""Soak: N concurrent streaming clients against a real fleet for D seconds.

Starts a ``loadtest.fleet.Fleet`` (private Redis, workers, gateway), then runs
``--clients`` closed-loop clients, each sending streaming chat requests back to
back (a shared system prompt, so the cache is exercised) until ``--duration``
ends. Meanwhile it samples the gateway process's RSS. At the end it waits for
every worker's used KV blocks to return to its pinned ones (no leaked
references) and prints one JSON object: requests, errors by kind (429s, which
the gateway sends on purpose when ``--max-queue-per-worker`` is set, are counted
apart), TTFT and latency percentiles, peak gateway RSS and the final block
state. Exit status 1 when an error other than a 429 occurred or blocks leaked.

    python -m loadtest.soak --clients 1000 --duration 60 --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
import resource
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.fleet import Fleet, FleetConfig
from loadtest.stats import latency_summary

logger = logging.getLogger(__name__)

_BLOCKS = re.compile(r'^kvroute_worker_blocks\{[^}]*state="(\w+)"[^}]*\}\s+(\S+)$', re.M)
SYSTEM = "You are a terse assistant in a soak test. Answer in one short sentence. " * 4


@dataclass
class Tally:
    """What every client saw, merged."""

    ok: int = 0
    throttled: int = 0  # deliberate 429s
    errors: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc (0 when unreadable)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


class RssSampler:
    """Samples one process's RSS on a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.start_rss = rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker_blocks(http_url: str) -> dict[str, int]:
    """``kvroute_worker_blocks`` by state from a worker's /metrics."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {state: int(float(v)) for state, v in _BLOCKS.findall(text)}


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], tally: Tally
) -> float:
    """One streaming request; returns seconds to wait before the next (Retry-After on 429)."""
    started = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status == 429:
                tally.throttled += 1
                return float(resp.headers.get("Retry-After", "1"))
            if resp.status != 200:
                tally.errors[f"http_{resp.status}"] += 1
                return 0.5
            first: float | None = None
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    tally.errors["stream_error:" + str(event["error"].get("code"))] += 1
                    return 0.5
                if first is None and any(
                    c.get("delta", {}).get("content") for c in event.get("choices", [])
                ):
                    first = time.perf_counter() - started
                if event.get("usage"):
                    tally.tokens += int(event["usage"].get("completion_tokens", 0))
            if not done:
                tally.errors["no_done"] += 1
                return 0.5
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.errors[type(exc).__name__] += 1
        return 0.5
    tally.ok += 1
    tally.e2e_s.append(time.perf_counter() - started)
    if first is not None:
        tally.ttft_s.append(first)
    return 0.0


async def _client(
    n: int, session: aiohttp.ClientSession, url: str, model: str, args: Any, tally: Tally
) -> None:
    end = time.monotonic() + args.duration
    i = 0
    while time.monotonic() < end:
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"client {n} question {i}: name a colour."},
            ],
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        pause = await _one(session, url, body, tally)
        i += 1
        if pause:
            await asyncio.sleep(min(pause, max(0.0, end - time.monotonic())))


async def run_clients(url: str, model: str, args: Any) -> tuple[Tally, float]:
    """Runs every client to the end of the duration; returns the tally and the wall time."""
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(_client(n, session, url, model, args, tally) for n in range(args.clients))
        )
    return tally, time.monotonic() - started


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(needed, soft)), hard))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1000, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--model", default="smollm2", help="model folder or the alias smollm2")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (keep small)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per worker")
    p.add_argument(
        "--max-queue-per-worker",
        type=int,
        default=0,
        help="gateway answers 429 past this queue depth (0 = never: every request waits)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="client timeout, s")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="wait for free blocks, s")
    p.add_argument("--log-dir", default="", help="write each process's log here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        raise SystemExit("--clients must be >= 1 and --duration > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _raise_fd_limit(args.clients * 2 + 256)
    gateway_args: tuple[str, ...] = ("--log-level", "warning")
    if args.max_queue_per_worker:
        gateway_args += ("--max-queue-per-worker", str(args.max_queue_per_worker))
    config = FleetConfig(
        model=args.model,
        workers=args.workers,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        gateway_args=gateway_args,
        worker_args=("--log-level", "WARNING"),
        log_dir=args.log_dir,
    )
    with Fleet(config) as fleet:
        assert fleet.gateway is not None
        with urllib.request.urlopen(fleet.gateway_url + "/v1/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        url = fleet.gateway_url + "/v1/chat/completions"
        with RssSampler(fleet.gateway.pid) as rss:
            tally, wall = asyncio.run(run_clients(url, model, args))
        deadline = time.monotonic() + args.drain_timeout
        while True:
            blocks = {w.worker_id: worker_blocks(w.http_url) for w in fleet.workers}
            free = all(b["used"] == b["pinned"] for b in blocks.values())
            if free or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    report = {
        "clients": args.clients,
        "duration_s": round(wall, 2),
        "workers": args.workers,
        "model": model,
        "max_tokens": args.max_tokens,
        "requests_ok": tally.ok,
        "requests_per_s": round(tally.ok / wall, 2) if wall else 0.0,
        "completion_tokens": tally.tokens,
        "throttled_429": tally.throttled,
        "errors": dict(tally.errors),
        "ttft_s": latency_summary(tally.ttft_s) if tally.ttft_s else {},
        "e2e_s": latency_summary(tally.e2e_s) if tally.e2e_s else {},
        "gateway_rss_start_mb": round(rss.start_rss / 2**20, 1),
        "gateway_rss_peak_mb": round(rss.peak / 2**20, 1),
        "all_blocks_free_at_end": free,
        "worker_blocks_at_end": blocks,
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if free and not tally.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
