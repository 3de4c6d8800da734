"""A gateway of several processes routes as one, with one block index: real Redis,
real gateway apps (in process, then the real ``kvroute gateway --processes 2``)
and fake gRPC workers."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from contract.hashing import block_hashes
from contract.redis_layout import RedisLayout
from gateway.routing.index_share import IndexServer, RemoteIndex
from gateway.routing.replicas import unbatched
from gateway.text.tokenizer import ChatTokenizer
from loadtest.fleet import free_port
from tests.gateway.conftest import MODEL, SPEC, Harness, MakeGateway
from tests.gateway.fakes import FakeRegistration, FakeWorker
from tests.gateway.helpers import eventually, namespace

ROOT = Path(__file__).resolve().parents[2]
LONG = [{"role": "user", "content": "a prompt of a few blocks, shared by every turn " * 12}]


@pytest.fixture
def socket_path() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")  # unix socket paths are short
    yield os.path.join(folder, "index.sock")
    shutil.rmtree(folder, ignore_errors=True)


async def _owner_and_front(make_gateway: MakeGateway, path: str) -> tuple[Harness, Harness]:
    ns = namespace()
    owner = await make_gateway(redis_namespace=ns, index_socket=path, index_owner=True, processes=2)
    front = await make_gateway(redis_namespace=ns, index_socket=path)
    # The owner is not ready before its front listens (``gateway.cli`` says when).
    await eventually(lambda: owner.state.mirror.has_snapshot, what="owner loaded")
    assert (await owner.client.get("/readyz")).status == 503
    assert isinstance(front.state.pod, RemoteIndex)
    front.state.pod.listening()
    await eventually(lambda: owner.state.pod.fronts_listening() == 1, what="front listens")  # type: ignore[union-attr]
    assert (await owner.client.get("/readyz")).status == 200
    assert isinstance(owner.state.pod, IndexServer)
    assert isinstance(front.state.pod, RemoteIndex)
    return owner, front


async def _pod_served(
    make_gateway: MakeGateway, path: str, at_owner: int, at_front: int
) -> tuple[Harness, Harness]:
    """An owner and a front with one worker, after ``at_owner`` and ``at_front`` chats."""
    owner, front = await _owner_and_front(make_gateway, path)
    await owner.add_worker("w0")
    await eventually(lambda: front.state.mirror.workers, what="front sees the worker")
    for g, n in ((owner, at_owner), (front, at_front)):
        for _ in range(n):
            assert (await g.chat(LONG)).status == 200
    return owner, front


async def test_a_front_routes_by_the_owners_index_and_keeps_none(
    make_gateway: MakeGateway, socket_path: str
) -> None:
    owner, front = await _owner_and_front(make_gateway, socket_path)
    for wid in ("w0", "w1", "w2"):
        await owner.add_worker(wid)
    await eventually(lambda: len(front.state.mirror.workers) == 3, what="front sees the fleet")
    hashes = owner.chat_hashes(LONG)
    await owner.workers["w2"][1].store(hashes)
    await eventually(lambda: owner.state.index.block_count("w2") == len(hashes), what="load")
    resp = await front.chat(LONG)
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-kvroute-worker"] == "w2"
    # The front mirrors the registry but no blocks: the pod holds one index.
    assert front.state.index.stats().entries == 0
    assert owner.state.index.stats().entries == len(hashes)
    pod = front.state.pod
    assert isinstance(pod, RemoteIndex)
    await pod.refresh_counts()
    assert pod.block_count("w2") == len(hashes)


async def test_a_fronts_routing_is_speculated_in_the_owners_index(
    make_gateway: MakeGateway, socket_path: str
) -> None:
    # No cache events at all: only the front's speculation can tell the owner (and so
    # the next look-up, from any process) where the new prompt went.
    owner, front = await _owner_and_front(make_gateway, socket_path)
    for wid in ("w0", "w1", "w2", "w3"):
        await owner.add_worker(wid)
    await eventually(lambda: len(front.state.mirror.workers) == 4, what="front sees the fleet")
    first = await front.chat(LONG)
    assert first.status == 200, await first.text()
    wid = first.headers["x-kvroute-worker"]
    chain = owner.chat_hashes(LONG)
    index = owner.state.index
    await eventually(
        lambda: index.longest_prefix(chain, time.monotonic()).get(wid) == len(chain),
        what="speculated at the owner",
    )
    again = await owner.chat(LONG)
    assert again.headers["x-kvroute-worker"] == wid


async def _chains_from(g: Harness) -> list[bool]:
    """Per entry ``g`` wrote to the routes stream that names a worker: whether it has a chain."""
    sync = g.state.dispatcher.replicas
    assert sync is not None
    entries = [e for _, batch in await g.redis.xrange(sync.stream_key) for e in unbatched(batch)]
    mine = sync.gateway_id.encode()
    return [b"c" in e for e in entries if e.get(b"g") == mine and b"w" in e]


async def _entries_from(g: Harness, n: int) -> list[bool]:
    """``_chains_from(g)`` once it holds ``n`` entries, or after 5 s whatever it holds."""
    deadline = time.monotonic() + 5.0
    while len(entries := await _chains_from(g)) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # the front flushes every 2 ms, on a busy host later
    return entries


async def test_the_processes_of_a_gateway_share_chains_only_with_other_gateways(
    make_gateway: MakeGateway, socket_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.routing import replicas

    monkeypatch.setattr(replicas, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(replicas, "PEER_TTL_S", 0.6)
    owner, front = await _owner_and_front(make_gateway, socket_path)
    for wid in ("w0", "w1"):
        await owner.add_worker(wid)
    await eventually(lambda: len(front.state.mirror.workers) == 2, what="front sees the fleet")
    owner_sync, front_sync = owner.state.dispatcher.replicas, front.state.dispatcher.replicas
    assert owner_sync is not None and front_sync is not None
    assert owner_sync.same_pod(front_sync.gateway_id) and front_sync.same_pod(owner_sync.gateway_id)
    await asyncio.sleep(replicas.PEER_TTL_S)  # past the start-up window: the peers are known
    # The owner's index has the front's chain from the index socket: the stream carries
    # the front's session and load, but no chain for the owner to speculate twice.
    resp = await front.chat(LONG, user="u1")
    assert resp.status == 200, await resp.text()
    wid = resp.headers["x-kvroute-worker"]
    chain = owner.chat_hashes(LONG)
    # The front's speculate message needs no answer: the owner may read it just after.
    await eventually(
        lambda: owner.state.index.longest_prefix(chain, time.monotonic()).get(wid) == len(chain),
        what="the owner holds the front's chain",
    )
    assert await _entries_from(front, 1) == [False]  # a route entry, no settle entry
    # Another gateway (another pod, its own index) joins: chains go to it again.
    other = await make_gateway(redis_namespace=owner.state.config.redis_namespace)
    await eventually(lambda: len(other.state.mirror.workers) == 2, what="other sees the fleet")
    await eventually(lambda: front_sync.rank()[1] == 3, what="the front hears the other gateway")
    long2 = [{"role": "user", "content": "another prompt of a few blocks, for the others " * 12}]
    resp = await front.chat(long2, user="u2")
    assert resp.status == 200, await resp.text()
    wid2, chain2 = resp.headers["x-kvroute-worker"], owner.chat_hashes(long2)
    await eventually(
        lambda: other.state.index.longest_prefix(chain2, time.monotonic()).get(wid2) == len(chain2),
        what="the other gateway speculates the front's chain",
    )
    # The settle entry follows the first token, in a later flush than the route entry.
    assert (await _entries_from(front, 3))[1:] == [True, True]  # route and settle


async def test_metrics_at_any_process_count_the_whole_pod(
    make_gateway: MakeGateway, socket_path: str
) -> None:
    for g in await _pod_served(make_gateway, socket_path, at_owner=2, at_front=3):
        text = await (await g.client.get("/metrics")).text()
        assert 'kvroute_gateway_responses_total{code="200"} 5.0' in text
        # A fleet gauge is the owner's view, not one per process added up.
        assert "kvroute_gateway_healthy_workers 1.0" in text


async def test_a_front_without_its_owner_routes_on_load_alone(socket_path: str) -> None:
    remote = RemoteIndex(socket_path)
    assert await remote.longest_prefix([1, 2, 3]) == {}  # never connected
    with pytest.raises(OSError):
        await remote.connect(lambda: asyncio.sleep(0, b""), timeout_s=0.2)


def test_processes_need_replica_sync(smollm2: Path) -> None:
    from gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="--replica-sync"):
        GatewayConfig(model_dir=smollm2, processes=2, replica_sync=False)


async def test_the_real_cli_serves_one_port_from_two_processes(
    redis_url: str, chat_tok: ChatTokenizer
) -> None:
    ns, port = namespace(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvroute_cli", "gateway", "--model", "smollm2"),
            *("--redis-url", redis_url, "--redis-namespace", ns, "--host", "127.0.0.1"),
            *("--port", str(port), "--processes", "2", "--access-log", "false"),
        ],
        cwd=ROOT,
        env=env,
    )
    redis = aioredis.Redis.from_url(redis_url)
    workers: list[FakeWorker] = []
    try:
        hashes = []
        for i in range(3):
            reply = [*chat_tok.encode_text("Hello"), 2]
            worker = await FakeWorker(f"w{i}", reply).start()
            workers.append(worker)
            reg = FakeRegistration(redis, RedisLayout(ns), f"w{i}", worker.address, SPEC)
            await reg.register()
            if i == 1:
                hashes = _hashes(chat_tok)
                await reg.store(hashes)
        base = f"http://127.0.0.1:{port}"
        pids = await _ready(base, proc)
        body = {"model": MODEL, "messages": LONG, "max_tokens": 4}
        seen = []
        # A new connection per request: the kernel spreads them over both processes.
        for _ in range(24):
            async with _fresh() as s, s.post(base + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                seen.append(resp.headers["x-kvroute-worker"])
        assert set(seen) == {"w1"}, seen  # every process found the prefix on w1
        for _ in range(4):
            async with _fresh() as s, s.get(base + "/metrics") as resp:
                text = await resp.text()
            assert 'kvroute_gateway_responses_total{code="200"} 24.0' in text
        # A front that dies is started again by the owner.
        (front,) = pids - {proc.pid}
        os.kill(front, signal.SIGKILL)
        again = await _ready(base, proc, timeout_s=120)
        assert proc.pid in again and front not in again
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        for worker in workers:
            await worker.stop()
        await redis.aclose()
    assert code == 0
    # The fronts stopped with the owner: nothing listens on the port any more.
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as s:
            await s.get(f"http://127.0.0.1:{port}/health")


def _fresh() -> aiohttp.ClientSession:
    """A client that opens a new connection per request (each lands on either process)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def _hashes(tok: ChatTokenizer) -> list[int]:
    return block_hashes(tok.encode_text(tok.render(LONG)), SPEC)


async def _ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> set[int]:
    """The two processes' pids, once both answer ready with the three workers (new
    connections land on either: each answer names its process)."""
    ready: set[int] = set()
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        assert proc.poll() is None, "the gateway exited"
        async with _fresh() as s:
            try:
                async with s.get(base + "/readyz?workers=3") as resp:
                    if resp.status == 200:
                        ready.add((await resp.json())["pid"])
            except aiohttp.ClientConnectionError:
                pass
        if len(ready) == 2:
            return ready
        await asyncio.sleep(0.05)
    raise TimeoutError(f"ready processes: {ready}, not 2")


async def test_a_front_that_does_not_answer_leaves_the_owners_metrics(
    socket_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.routing import index_share
    from gateway.routing.index import BlockIndex

    monkeypatch.setattr(index_share, "ASK_TIMEOUT_S", 0.2)
    owner_text = b"# TYPE kvroute_gateway_x_total counter\nkvroute_gateway_x_total 3.0\n"

    async def owner_render() -> bytes:
        return owner_text

    async def hung_render() -> bytes:
        await asyncio.sleep(3600)
        return b""

    server = IndexServer(socket_path, BlockIndex())
    await server.start(owner_render)
    front = RemoteIndex(socket_path)
    await front.connect(hung_render)
    try:
        started = time.monotonic()
        text = (await server.pod_metrics()).decode()
        assert time.monotonic() - started < 2
        assert "kvroute_gateway_x_total 3.0" in text
    finally:
        await server.close()


async def test_the_dashboard_at_any_process_shows_the_whole_pods_traffic(
    make_gateway: MakeGateway, socket_path: str
) -> None:
    for g in await _pod_served(make_gateway, socket_path, at_owner=1, at_front=2):
        data = await (await g.client.get("/dashboard/data")).json()
        assert data["fleet"]["responses"] == {"200": 3}
        (worker,) = data["workers"]
        assert worker["reasons"] and sum(worker["reasons"].values()) == 3


def test_processes_0_is_one_per_usable_core(tmp_path: Path, smollm2: Path) -> None:
    from gateway.cli import config_from_args
    from gateway.processes import usable_cores

    cores = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")
    assert usable_cores(limit) == cores
    limit.write_text("50000 100000\n")  # half a core: still one process
    assert usable_cores(limit) == 1
    limit.write_text(f"{cores * 100000 + 1} 100000\n")  # a limit above the affinity
    assert usable_cores(limit) == cores
    assert usable_cores(tmp_path / "absent") == cores
    config = config_from_args(["--model", str(smollm2), "--processes", "0"])
    assert config.processes == usable_cores()
