"""Acceptance: real Redis, three real worker processes on tiny_llama, real gateway processes.

Everything over the wire: the official ``openai`` client against the gateway
(``kvroute gateway``), gRPC from the gateway to ``kvroute worker`` processes,
and the workers' own HTTP front for the reference token ids. The last test
kills a worker, so it stays last in the file.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from gateway.text.tokenizer import ChatTokenizer
from tests.gateway.helpers import namespace
from tests.support import free_port, wait_for_port, wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _spawn(name: str, args: list[str], log_dir: Path, port: int) -> Proc:
    log = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute_cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    return Proc(name, proc, port, log)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@dataclass
class Fleet:
    model: Path
    name: str
    workers: dict[str, Proc]
    gateways: dict[str, Proc]

    def url(self, gateway: str = "kvroute") -> str:
        return f"http://127.0.0.1:{self.gateways[gateway].port}"

    def client(self, gateway: str = "kvroute") -> OpenAI:
        return OpenAI(base_url=self.url(gateway) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def fleet(
    tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet-logs")
    ns = namespace()
    workers: dict[str, Proc] = {}
    gateways: dict[str, Proc] = {}
    try:
        for i in range(3):
            grpc_port, http_port = free_port(), free_port()
            p = _spawn(
                f"w{i}",
                [
                    "worker",
                    "--model",
                    str(tiny_llama),
                    "--redis-url",
                    redis_url,
                    "--redis-namespace",
                    ns,
                    "--worker-id",
                    f"w{i}",
                    "--grpc-port",
                    str(grpc_port),
                    "--http-port",
                    str(http_port),
                    "--num-blocks",
                    "512",
                    "--heartbeat-interval",
                    "0.3",
                    "--heartbeat-ttl",
                    "1.5",
                    "--log-level",
                    "WARNING",
                ],
                logs,
                grpc_port,
            )
            p.extra["http_port"] = http_port
            workers[p.name] = p
        for policy in ("kvroute", "round_robin"):
            port = free_port()
            gateways[policy] = _spawn(
                f"gateway-{policy}",
                [
                    "gateway",
                    "--model",
                    str(tiny_llama),
                    "--redis-url",
                    redis_url,
                    "--redis-namespace",
                    ns,
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                    "--policy",
                    policy,
                    "--log-level",
                    "warning",
                ],
                logs,
                port,
            )
        for p in [*workers.values(), *gateways.values()]:
            wait_for_port(p.port, timeout=120)
        for p in workers.values():
            wait_for_port(p.extra["http_port"], timeout=60)
        f = Fleet(tiny_llama, tiny_llama.resolve().name, workers, gateways)
        for g in gateways:
            wait_until(
                lambda g=g: (
                    _get(f.url(g) + "/readyz").get("healthy_workers") == 3
                    if _ready(f.url(g))
                    else False
                ),
                timeout=60,
                what=f"{g} sees 3 workers",
            )
        yield f
    finally:
        procs = [*gateways.values(), *workers.values()]
        for p in procs:  # signal all first, so their graceful shutdowns overlap
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop()
        for p in [*gateways.values(), *workers.values()]:
            if p.proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
                print(f"--- {p.name} exited {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")


def _ready(url: str) -> bool:
    try:
        return bool(_get(url + "/readyz").get("ready"))
    except OSError:
        return False


def _words(rng: random.Random, n: int) -> str:
    vocab = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "cache",
        "block",
        "route",
        "token",
        "worker",
        "prefix",
        "hash",
        "chain",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_openai_client_chat_and_completions(fleet: Fleet) -> None:
    client = fleet.client()
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    chat = client.chat.completions.create(
        model=fleet.name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 8
    assert chat.usage.prompt_tokens_details is not None
    stream = client.chat.completions.create(
        model=fleet.name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy: same text both ways
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == (
        chat.usage.completion_tokens
    )
    comp = client.completions.create(
        model=fleet.name, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert comp.choices[0].text and comp.usage is not None
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=fleet.name, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
        )
    )
    assert text == comp.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == [fleet.name]


def test_gateway_ids_equal_worker_ids(fleet: Fleet) -> None:
    tok = ChatTokenizer(fleet.model)  # the gateway's own tokenizer class, incremental on
    worker_http = f"http://127.0.0.1:{fleet.workers['w0'].extra['http_port']}"
    rng = random.Random(3)
    pieces = ["hi", " there", "\n\n", "é", "世界", "🙂", "  ", "<b>", "?", "\t"]
    for _ in range(12):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": "".join(rng.choices(pieces, k=5))})
        for _turn in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": "".join(rng.choices(pieces, k=8))})
            ours = asyncio.run(tok.aencode_rendered(tok.render(messages))).ids
            theirs = _post(worker_http + "/v1/chat/completions/render", {"messages": messages})
            assert ours == theirs["token_ids"]
            messages.append({"role": "assistant", "content": "".join(rng.choices(pieces, k=6))})
    assert tok.prefix_cache is not None and tok.prefix_cache.hits > 0


def test_gateway_prompt_ids_equal_worker_ids(fleet: Fleet) -> None:
    """Plain prompts sharing long text prefixes: the gateway's incremental ids (reusing the
    shared prefix, ``gateway.text.prompt_prefix``) equal what the worker tokenizes itself."""
    tok = ChatTokenizer(fleet.model)
    assert tok.prompt_cache is not None
    worker_http = f"http://127.0.0.1:{fleet.workers['w0'].extra['http_port']}"
    rng = random.Random(5)
    pieces = [" the", " cache", "\n", "\n\n", " é", "世界", "🙂", "  ", ".", " 42", "\t", "ok"]
    shared = "".join(rng.choices(pieces, k=400))
    for _ in range(6):
        prompt = shared[: rng.randint(len(shared) // 2, len(shared))]
        prompt += "".join(rng.choices(pieces, k=rng.randint(0, 60)))
        ours = asyncio.run(tok.aencode_prompt(prompt)).ids
        theirs = _post(worker_http + "/v1/completions/render", {"prompt": prompt})
        assert ours == theirs["token_ids"]
    assert tok.prompt_cache.hits > 0


def _chat_raw(client: OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )  # type: ignore[arg-type]
    body = raw.parse()
    return raw.headers["x-kvroute-worker"], raw.headers["x-kvroute-reason"], body


def test_follow_up_turn_goes_to_the_same_worker_and_hits(fleet: Fleet) -> None:
    client = fleet.client()
    rng = random.Random(11)
    messages = [{"role": "user", "content": _words(rng, 60)}]
    prev_worker, _, body = _chat_raw(client, fleet.name, messages)
    for _turn in range(3):
        prev_prompt = body.usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": body.choices[0].message.content},
            {"role": "user", "content": _words(rng, 20)},
        ]
        worker, reason, body = _chat_raw(client, fleet.name, messages)
        assert worker == prev_worker
        assert reason == "cache"
        cached = body.usage.prompt_tokens_details.cached_tokens
        assert cached >= (prev_prompt // BLOCK) * BLOCK
        assert cached >= BLOCK * 3


async def _conversation(client: AsyncOpenAI, model: str, seed: int, turns: int) -> list[Any]:
    rng = random.Random(seed)
    messages = [{"role": "user", "content": _words(rng, 50)}]
    out = []
    for _ in range(turns):
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )  # type: ignore[arg-type]
        body = raw.parse()
        out.append((raw.headers["x-kvroute-worker"], raw.headers["x-kvroute-reason"], body.usage))
        messages += [
            {"role": "assistant", "content": body.choices[0].message.content or ""},
            {"role": "user", "content": _words(rng, 15)},
        ]
    return out


def _run_conversations(fleet: Fleet, gateway: str, seeds: list[int], turns: int) -> list[Any]:
    async def main() -> list[Any]:
        client = AsyncOpenAI(base_url=fleet.url(gateway) + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(
                *(_conversation(client, fleet.name, s, turns) for s in seeds)
            )
        finally:
            await client.close()

    return asyncio.run(main())


def test_concurrent_conversations_keep_their_worker(fleet: Fleet) -> None:
    results = _run_conversations(fleet, "kvroute", list(range(100, 110)), turns=2)
    assert len(results) == 10 and all(len(conv) == 2 for conv in results)
    firsts = collections.Counter(first for (first, _, _), _ in results)
    stayed = 0
    for conv in results:
        (first, _, _), (second, reason, usage) = conv
        if second == first:
            # A follow-up turn that stays finds its first turn's blocks there.
            stayed += 1
            assert reason in ("cache", "session"), conv
            assert usage.prompt_tokens_details.cached_tokens > 0, conv
        else:
            # Leaving them is a spill, said as one: for a prompt this short the few
            # uncached tokens cost less than queueing behind a busier worker's decodes
            # (``decode_weight_s``), so within the tie margin load decides.
            assert reason == "load", (conv, firsts)
    # Where ten short cold conversations start is not asserted: their prompts queue
    # milliseconds of work, below the bounded-load rule's 2 s work slack, so the spread
    # comes from each worker's measured prefill rate, which is noisy on a shared CPU
    # (all ten on one of three workers was seen in CI). On a spread start most stay: a
    # worker then carries at most three other conversations, and a follow-up leaves it
    # only while another worker has next to none in flight.
    if max(firsts.values()) <= 4:
        assert stayed >= 6, (results, firsts)


def test_round_robin_caches_less_than_kvroute(fleet: Fleet) -> None:
    def cached_share(gateway: str, seed: int) -> tuple[float, list[tuple[str, str, int, int]]]:
        # One conversation at a time, so round robin's rotation moves every follow-up turn
        # to another worker (concurrent lockstep conversations could line up by chance).
        # The first turn is long: for a tiny model a short prompt's prefill is nearly free
        # anywhere, so one noisy rate reading (a worker that only prefilled 30-token
        # follow-ups, timed on a loaded CI host) once moved a follow-up off its history.
        client = fleet.client(gateway)
        rng = random.Random(seed)
        turns, follow_ups = [], []
        for _conv in range(2):
            messages = [{"role": "user", "content": _words(rng, 360)}]
            for turn in range(4):
                worker, reason, body = _chat_raw(client, fleet.name, messages)
                usage = body.usage
                turns.append(
                    (worker, reason, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
                )
                if turn:
                    follow_ups.append(turns[-1])
                messages += [
                    {"role": "assistant", "content": body.choices[0].message.content},
                    {"role": "user", "content": _words(rng, 10)},
                ]
        return sum(t[3] for t in follow_ups) / sum(t[2] for t in follow_ups), turns

    kv, kv_turns = cached_share("kvroute", 200)
    rr, rr_turns = cached_share("round_robin", 300)
    # Each turn as (worker, reason, prompt tokens, cached tokens). Every follow-up on its
    # history's worker gives 0.93; one moved follow-up costs about 0.17, two fail.
    assert kv > 0.7, (kv, kv_turns)
    assert kv - rr > 0.4, (kv, rr, kv_turns, rr_turns)


def test_killed_worker_leaves_routing_and_index(fleet: Fleet) -> None:
    client = fleet.client()
    victim = fleet.workers["w2"]
    victim.stop(signal.SIGKILL)  # no deregistration: the registry key must expire
    t0 = time.monotonic()
    seen = set()
    while time.monotonic() - t0 < 4:
        worker, _, body = _chat_raw(
            client, fleet.name, [{"role": "user", "content": f"still serving {time.monotonic()}"}]
        )
        assert body.choices[0].finish_reason in ("stop", "length")
        seen.add(worker)
    assert "w2" not in seen
    data = wait_until(
        lambda: (
            (d := _get(fleet.url() + "/dashboard/data"))
            and "w2" not in [w["worker_id"] for w in d["workers"]]
            and d
        ),
        timeout=10,
        what="w2 dropped",
    )
    assert sorted(w["worker_id"] for w in data["workers"]) == ["w0", "w1"]
    metrics = urllib.request.urlopen(fleet.url() + "/metrics", timeout=10).read().decode()
    assert 'kvroute_gateway_index_blocks{worker_id="w2"}' not in metrics
    assert "kvroute_gateway_healthy_workers 2.0" in metrics
    for _ in range(3):
        worker, _, _ = _chat_raw(client, fleet.name, [{"role": "user", "content": "after"}])
        assert worker in ("w0", "w1")
