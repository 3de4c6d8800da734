"""The worker's servers end to end: real engine + model runner, real gRPC, HTTP, Redis.

A ``Stack`` is what ``kvroute worker`` builds in-process (engine thread,
publisher, gRPC server, HTTP front) on the tiny random-weight Llama; one test
runs the real command in a subprocess, one serves the real SmolLM2.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.hashing import HashSpec
from contract.redis_layout import RedisLayout, WorkerRecord, decode_block_set
from tests.support import RedisProcess, free_port, wait_until
from worker.engine.thread import Engine, EngineConfig
from worker.publish.publisher import EventQueue, Publisher, PublisherConfig
from worker.serve.grpc_server import WorkerService, start_grpc_server
from worker.serve.http_server import create_app, start_http_server
from worker.serve.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 80  # 1,280 tokens: one 1,000-token prompt fits, two evict each other
BLOCK = 16


@pytest.fixture(scope="module")
def runner(tiny_llama: Path):
    from worker.model.runner import ModelRunner

    return ModelRunner(tiny_llama, block_size=BLOCK, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


class Stack:
    """Engine + publisher + gRPC + HTTP, wired as ``worker.serve.cli`` wires them."""

    def __init__(self, runner, tokenizer, redis_url: str, model: str = "tiny") -> None:
        self.worker_id = "w-" + uuid.uuid4().hex[:8]
        self.layout = RedisLayout("t" + uuid.uuid4().hex[:10])
        self.spec = HashSpec(block_size=runner.block_size, model=model)
        self.queue = EventQueue()
        self.engine = Engine(
            runner,
            EngineConfig(max_num_seqs=8, max_batch_tokens=2048),
            hash_spec=self.spec,
            on_events=self.queue.put,
        )
        self.metrics = WorkerMetrics(self.engine, self.worker_id)
        self.publisher = Publisher(
            self.engine,
            self.queue,
            PublisherConfig(
                redis_url=redis_url,
                worker_id=self.worker_id,
                namespace=self.layout.namespace,
                heartbeat_interval=0.2,
                heartbeat_ttl=1.0,
                retry_min_s=0.05,
                retry_max_s=0.3,
            ),
            WorkerRecord(
                self.worker_id,
                "",
                model=model,
                hash_spec=self.spec.describe(),
                block_size=BLOCK,
                num_blocks=self.engine.num_blocks,
                max_model_len=self.engine.max_model_len,
            ),
        )
        self.tokenizer = tokenizer
        self.model = model
        self.redis = aioredis.from_url(redis_url)

    async def start(self) -> Stack:
        self.engine.start()
        service = WorkerService(self.engine, worker_id=self.worker_id)
        self.grpc_server, self.grpc_port = await start_grpc_server(service, "127.0.0.1", 0)
        app = create_app(
            self.engine,
            self.tokenizer,
            model_name=self.model,
            worker_id=self.worker_id,
            metrics=self.metrics,
        )
        self.http_runner, self.http_port = await start_http_server(app, "127.0.0.1", 0)
        self.publisher.update_record(address=f"127.0.0.1:{self.grpc_port}")
        await self.publisher.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.http = aiohttp.ClientSession(f"http://127.0.0.1:{self.http_port}")
        self.openai = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0
        )
        return self

    async def close(self) -> None:
        await self.openai.close()
        await self.http.close()
        await self.channel.close()
        await self.publisher.stop()
        await self.grpc_server.stop(0)
        await self.http_runner.cleanup()
        self.engine.shutdown()
        await self.redis.aclose()

    async def generate(self, prompt: list[int], max_tokens: int = 4, **kw) -> list:
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}
        request = pb.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(**sampling),
        )
        return [chunk async for chunk in self.stub.Generate(request)]

    async def redis_set(self) -> set[int]:
        return set(decode_block_set(await self.redis.hvals(self.layout.blocks(self.worker_id))))

    async def wait_set_matches_pool(self, timeout: float = 5.0) -> set[int]:
        deadline = time.monotonic() + timeout
        while True:
            resident = self.engine.resident_block_hashes()
            if await self.redis_set() == resident:
                return resident
            if time.monotonic() > deadline:
                raise AssertionError("the Redis block set never matched the pool")
            await asyncio.sleep(0.02)

    async def wait_idle(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.stats().free_blocks != self.engine.num_blocks:
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks not freed: {self.engine.stats()}")
            await asyncio.sleep(0.01)


@pytest.fixture
async def stack(runner, tokenizer, redis_url: str):
    s = await Stack(runner, tokenizer, redis_url).start()
    yield s
    await s.close()


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(n)]


# --- gRPC ---------------------------------------------------------------------------------


async def test_generate_streams_tokens_with_usage_on_the_final_chunk(stack: Stack) -> None:
    chunks = await stack.generate(random_ids(40, 1), max_tokens=6)
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 6 and len(chunks) >= 2
    final = chunks[-1]
    assert final.finished and not any(c.finished for c in chunks[:-1])
    assert (final.finish_reason, final.worker_id) == ("length", stack.worker_id)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (40, 6)
    assert final.usage.cached_tokens == 0 and final.ttft_s > 0


async def test_a_second_grpc_server_on_a_used_port_fails(stack: Stack) -> None:
    # No SO_REUSEPORT: a twin on the same port would silently share the first one's traffic.
    twin = WorkerService(stack.engine, worker_id="twin")
    with pytest.raises(OSError, match="--grpc-port"):
        await start_grpc_server(twin, "127.0.0.1", stack.grpc_port)


async def test_shared_prefix_is_cached_and_redis_mirrors_the_pool(stack: Stack) -> None:
    # Acceptance: a second request sharing a 1,000-token prefix reports the shared
    # full blocks as cached, and Redis holds exactly the pool's resident hashes,
    # before and after evictions.
    prefix = random_ids(1000, 2)
    await stack.generate(prefix + random_ids(12, 3), max_tokens=2)
    second = await stack.generate(prefix + random_ids(12, 4), max_tokens=2)
    assert second[-1].usage.cached_tokens == (1000 // BLOCK) * BLOCK == 992
    # The first chunk already carries them, so a caller that stops early still counts them.
    assert (second[0].usage.prompt_tokens, second[0].usage.cached_tokens) == (1012, 992)
    before = await stack.wait_set_matches_pool()
    assert len(before) >= 1000 // BLOCK
    assert stack.engine.stats().evictions_total == 0

    await stack.generate(random_ids(1000, 5), max_tokens=2)  # does not fit beside the first
    assert stack.engine.stats().evictions_total > 0
    after = await stack.wait_set_matches_pool()
    assert before - after  # evicted hashes left the Redis set too
    assert len(after) <= NUM_BLOCKS


async def test_cancelled_call_aborts_and_frees_blocks(stack: Stack) -> None:
    request = pb.GenerateRequest(
        request_id="r-cancel",
        prompt_token_ids=random_ids(100, 6),
        sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True),
    )
    call = stack.stub.Generate(request)
    first = await call.read()
    assert first.token_ids and stack.engine.stats().running == 1
    call.cancel()
    await stack.wait_idle()
    assert stack.engine.stats().running == 0


@pytest.mark.parametrize(
    ("prompt", "sampling", "needle"),
    [
        ([5, 10**6], {}, "vocabulary"),
        ([], {}, "at least one token"),
        ([5, 6], {"top_p": 1.5}, "top_p"),
        ([5, 6], {"temperature": -1.0}, "temperature"),
        ([5] * 2000, {}, "max_model_len"),
    ],
)
async def test_bad_requests_are_invalid_argument_and_the_engine_keeps_going(
    stack: Stack, prompt: list[int], sampling: dict, needle: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt, max_tokens=4, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    ok = await stack.generate([5, 6, 7], max_tokens=2)
    assert ok[-1].finish_reason == "length"


async def test_a_stopped_engine_answers_unavailable(stack: Stack) -> None:
    stack.engine.shutdown()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate([5, 6, 7], max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with stack.http.post("/v1/completions", json={"prompt": "hi"}) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "service_unavailable"


async def test_health(stack: Stack) -> None:
    health = await stack.stub.Health(pb.HealthRequest())
    assert health.serving and health.free_blocks == NUM_BLOCKS and health.running == 0


async def test_grpc_over_tls(runner, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    engine = Engine(runner, EngineConfig(), hash_spec=HashSpec(BLOCK, "tiny"))
    engine.start()
    service = WorkerService(engine, worker_id="tls")
    server, port = await start_grpc_server(service, "127.0.0.1", 0, tls_cert=cert, tls_key=key)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    try:
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            health = await worker_pb2_grpc.WorkerStub(channel).Health(pb.HealthRequest())
            assert health.serving and health.free_blocks == NUM_BLOCKS
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await worker_pb2_grpc.WorkerStub(plain).Health(pb.HealthRequest(), timeout=2)
        # The gateway's worker clients dial the same server over TLS with --grpc-tls-ca.
        from gateway.upstream.grpc_worker import GrpcUpstream

        clients = GrpcUpstream(tls_ca=cert.read_bytes())
        try:
            stub = clients.stub("tls", f"localhost:{port}")
            assert (await stub.Health(pb.HealthRequest(), timeout=5)).serving
        finally:
            await clients.close()
    finally:
        await server.stop(0)
        engine.shutdown()


# --- HTTP ---------------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


async def test_chat_stream_matches_non_stream_and_reports_cached_tokens(stack: Stack) -> None:
    args = dict(
        model="tiny",
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "some_unknown_field": {"x": 1}},
    )
    full = await stack.openai.chat.completions.create(**args)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    prompt_ids = stack.tokenizer.encode(
        stack.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert full.usage.prompt_tokens == len(prompt_ids)

    stream = await stack.openai.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // BLOCK * BLOCK > 0


async def test_completions_stream_and_max_completion_tokens(stack: Stack) -> None:
    stream = await stack.openai.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].text async for c in stream if c.choices]
    full = await stack.openai.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert "".join(pieces) == full.choices[0].text
    async with stack.http.post(
        "/v1/completions",
        json={
            "prompt": stack.tokenizer.encode("Once upon a time"),
            "max_completion_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {},
            "whatever": 1,
        },
    ) as resp:
        body = await resp.json()
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # 4 tokens: no block


async def test_raw_sse_ends_with_done(stack: Stack) -> None:
    async with stack.http.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 3, "stream": True, "temperature": 0},
    ) as resp:
        raw = (await resp.read()).decode()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


async def test_http_client_disconnect_aborts_the_request(stack: Stack) -> None:
    async with stack.http.post(
        "/v1/completions",
        json={
            "prompt": "tell me everything",
            "max_tokens": 1000,
            "stream": True,
            "ignore_eos": True,
        },
    ) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        assert stack.engine.stats().running == 1
        resp.close()  # drop the connection mid-stream
    await stack.wait_idle()
    assert stack.engine.stats().running == 0


async def test_stop_string_truncates_and_frees(stack: Stack) -> None:
    args = dict(
        model="tiny",
        prompt="The weather today",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = (await stack.openai.completions.create(**args)).choices[0].text
    assert len(text) >= 8
    stop = text[4:7]
    cut = await stack.openai.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    await stack.wait_idle()


async def test_tokenize_render_and_helper_endpoints(stack: Stack) -> None:
    tok = stack.tokenizer
    async with stack.http.post("/tokenize", json={"prompt": "hello world"}) as resp:
        body = await resp.json()
    assert body["tokens"] == body["token_ids"] == tok.encode("hello world")
    assert body["count"] == len(body["tokens"])
    async with stack.http.post("/detokenize", json={"tokens": body["tokens"]}) as resp:
        assert (await resp.json())["prompt"] == "hello world"
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    async with stack.http.post(
        "/v1/chat/completions/render", json={"model": "tiny", "messages": CHAT}
    ) as resp:
        body = await resp.json()
    assert body["token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert body["prompt"] == rendered
    async with stack.http.post("/v1/completions/render", json={"prompt": "hi"}) as resp:
        assert (await resp.json()) == {"token_ids": tok.encode("hi")}
    async with stack.http.get("/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
    for path in ("/health", "/healthz", "/readyz"):  # the gateway's probe paths as well
        async with stack.http.get(path) as resp:
            assert resp.status == 200, path
    async with stack.http.get("/get_load") as resp:
        load = await resp.json()
    assert load["load"] == 0 and load["free_blocks"] == NUM_BLOCKS
    for path in ("/server_info", "/model_info"):
        async with stack.http.get(path) as resp:
            assert resp.status == 404


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 17}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": [1, 10**7]}, None),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ],
)
async def test_bad_http_input_is_an_openai_shaped_400(
    stack: Stack, path: str, payload: dict, param: str | None
) -> None:
    async with stack.http.post(path, json=payload) as resp:
        body = await resp.json()
    assert resp.status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param
    async with stack.http.post(path, data=b"{not json") as resp:
        assert resp.status == 400
    with pytest.raises(openai.NotFoundError):
        await stack.openai.completions.create(model="other", prompt="x", max_tokens=1)


async def test_metrics_expose_every_documented_name(stack: Stack) -> None:
    await stack.openai.completions.create(
        model="tiny", prompt="a b c", max_tokens=3, extra_body={"ignore_eos": True}
    )
    documented = set(
        re.findall(r"`(kvroute_worker_[a-z0-9_]+)`", (ROOT / "docs" / "INTERFACES.md").read_text())
    )
    assert len(documented) == 16
    wid = ("worker_id", stack.worker_id)
    finished = ("kvroute_worker_requests_total", (("finish_reason", "length"), wid))
    deadline = time.monotonic() + 5
    while True:  # the engine records a finished request just after its last output
        async with stack.http.get("/metrics") as resp:
            text = await resp.text()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not family.name.startswith(("process_", "python_")):
                    assert sample.labels.get("worker_id") == stack.worker_id
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        if samples[finished] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    names = {name for name, _ in samples}
    exposed = names | {n.removesuffix("_count") for n in names}
    assert documented <= exposed, documented - exposed
    assert samples[finished] == 1
    assert samples[("kvroute_worker_generation_tokens_total", (wid,))] == 3
    assert samples[("kvroute_worker_ttft_seconds_count", (wid,))] == 1
    assert samples[("kvroute_worker_inter_token_latency_seconds_count", (wid,))] == 2
    assert samples[("kvroute_worker_block_capacity", (wid,))] == NUM_BLOCKS
    # The states partition the pool: used + free is the capacity, whatever is cached.
    used = samples[("kvroute_worker_blocks", (("state", "used"), wid))]
    free = samples[("kvroute_worker_blocks", (("state", "free"), wid))]
    assert used + free == NUM_BLOCKS
    assert 0 <= samples[("kvroute_worker_cached_blocks", (wid,))] <= NUM_BLOCKS
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert not any(name.startswith("vllm:") for name in names)  # aliases are opt-in


async def test_vllm_metric_aliases_mirror_the_kvroute_counters(stack: Stack) -> None:
    await stack.openai.completions.create(model="tiny", prompt="a b c d e", max_tokens=2)
    text = WorkerMetrics(stack.engine, stack.worker_id, "tiny").render().decode()
    values = {
        (s.name, s.labels.get("model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    prompt = values[("kvroute_worker_prompt_tokens_total", None)]
    assert prompt > 0
    assert values[("vllm:prompt_tokens_total", "tiny")] == prompt
    assert values[("vllm:prefix_cache_queries_total", "tiny")] == prompt
    assert (
        values[("vllm:prefix_cache_hits_total", "tiny")]
        == (values[("kvroute_worker_cached_prompt_tokens_total", None)])
    )
    assert (
        values[("vllm:generation_tokens_total", "tiny")]
        == (values[("kvroute_worker_generation_tokens_total", None)])
    )
    assert ("vllm:num_requests_running", "tiny") in values
    assert 0 <= values[("vllm:kv_cache_usage_perc", "tiny")] <= 1


# --- faults and the real command ----------------------------------------------------------


async def test_killing_redis_does_not_fail_requests_and_restart_restores_state(
    runner, tokenizer, redis_process: RedisProcess
) -> None:
    s = await Stack(runner, tokenizer, redis_process.url).start()
    try:
        await s.generate(random_ids(64, 8), max_tokens=2)
        await s.wait_set_matches_pool()
        redis_process.stop(kill=True)
        chunks = await s.generate(random_ids(64, 9), max_tokens=3)
        assert chunks[-1].finish_reason == "length"
        reply = await s.openai.completions.create(model="tiny", prompt="still up", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
        redis_process.start()
        s.redis = aioredis.from_url(redis_process.url)
        resident = await s.wait_set_matches_pool(timeout=5)
        assert len(resident) >= 8  # both 64-token prompts' blocks
        record = WorkerRecord.from_mapping(await s.redis.hgetall(s.layout.worker(s.worker_id)))
        assert record.epoch == s.publisher.epoch and record.address.endswith(str(s.grpc_port))
    finally:
        await s.close()


async def test_smollm2_chat_over_http(smollm2: Path, redis_url: str) -> None:
    from transformers import AutoTokenizer

    from worker.model.runner import ModelRunner

    model_runner = ModelRunner(smollm2, block_size=BLOCK, num_blocks=64)
    s = await Stack(
        model_runner,
        AutoTokenizer.from_pretrained(smollm2),
        redis_url,
        model="SmolLM2-135M-Instruct",
    ).start()
    try:
        args = dict(
            model="SmolLM2-135M-Instruct",
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        first = await s.openai.chat.completions.create(**args)
        again = await s.openai.chat.completions.create(**args)
        assert "Paris" in first.choices[0].message.content
        assert again.choices[0].message.content == first.choices[0].message.content
        prompt = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == prompt // BLOCK * BLOCK
        await s.wait_set_matches_pool()
    finally:
        await s.close()


def test_kvroute_worker_command_serves_registers_and_deregisters_on_sigterm(
    tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    grpc_port, http_port = free_port(), free_port()
    namespace, worker_id = "t" + uuid.uuid4().hex[:10], "sub-" + uuid.uuid4().hex[:6]
    layout = RedisLayout(namespace)
    log = tmp_path / "worker.log"
    system = tmp_path / "system.txt"
    system.write_text("You are a careful assistant. " * 8)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute_cli",
            "worker",
            "--model",
            str(tiny_llama),
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--worker-id",
            worker_id,
            "--num-blocks",
            "64",
            "--heartbeat-interval",
            "0.2",
            "--heartbeat-ttl",
            "2",
            "--log-level",
            "INFO",
            "--pin-system-prompt",
            str(system),
        ],
        cwd=ROOT,
        env={**os.environ, "KVROUTE_REDIS_URL": redis_url, "KVROUTE_REDIS_NAMESPACE": namespace},
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    client = redis.Redis.from_url(redis_url)
    try:
        raw = wait_until(
            lambda: proc.poll() is None and client.hgetall(layout.worker(worker_id)),
            timeout=90,
            what="worker registered",
        )
        record = WorkerRecord.from_mapping(raw)
        assert record.address == f"127.0.0.1:{grpc_port}"
        assert record.http_address == f"127.0.0.1:{http_port}"
        assert (record.model, record.num_blocks) == (tiny_llama.name, 64)
        assert record.hash_spec["model"] == tiny_llama.name

        async def talk() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                request = pb.GenerateRequest(
                    prompt_token_ids=random_ids(40, 10),
                    sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
                )
                chunks = [c async for c in stub.Generate(request)]
                assert chunks[-1].usage.completion_tokens == 3
            async with aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as http:
                async with http.get("/health") as resp:
                    assert resp.status == 200
                async with http.get("/metrics") as resp:
                    metrics = await resp.text()
            pinned = re.search(r'kvroute_worker_pinned_blocks\{worker_id="[^"]+"\} (\S+)', metrics)
            assert pinned and float(pinned.group(1)) >= 3  # ~70-token system message

        asyncio.run(talk())
        assert decode_block_set(client.hvals(layout.blocks(worker_id)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert (
            client.exists(
                layout.worker(worker_id), layout.blocks(worker_id), layout.events(worker_id)
            )
            == 0
        )
        stderr = log.read_text()
        assert f"grpc_port={grpc_port} http_port={http_port}" in stderr
        assert "deregistered" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()


async def test_http_front_serves_n_choices_and_logprobs(stack: Stack) -> None:
    args: dict = dict(
        model="tiny", prompt="a b c d", max_tokens=4, n=2, temperature=1.0, seed=5,
        logprobs=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    out = await stack.openai.completions.create(**args)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 8
    for c in out.choices:
        lp = c.logprobs
        assert lp is not None and len(lp.token_logprobs) == 4 and "".join(lp.tokens) == c.text
        assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 1 for t in lp.top_logprobs)
    texts = {0: "", 1: ""}
    async for chunk in await stack.openai.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}  # same seeds, same draws


async def test_reset_prefix_cache_over_http_clears_the_pool_and_redis(stack: Stack) -> None:
    await stack.generate(random_ids(40, 11), max_tokens=2)
    assert await stack.wait_set_matches_pool()  # two full blocks cached, in Redis too
    async with stack.http.post("/reset_prefix_cache") as resp:
        assert resp.status == 200
    assert await stack.wait_set_matches_pool() == set()
