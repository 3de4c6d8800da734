"""The worker's gRPC front end to end: real engine + tiny Llama, real gRPC and Redis.

Streaming with usage, prefix caching mirrored in Redis, cancellation, bad input,
a stopped engine, health and TLS.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from contract import prompt_wire, worker_pb2_grpc
from contract import worker_pb2 as pb
from contract.hashing import HashSpec
from tests.worker.server_stack import BLOCK, NUM_BLOCKS, Stack, random_ids
from worker.engine.thread import Engine, EngineConfig
from worker.serve.grpc_server import WorkerService, start_grpc_server

pytestmark = pytest.mark.timeout(60)


async def test_generate_streams_tokens_with_usage_on_the_final_chunk(stack: Stack) -> None:
    chunks = await stack.generate(random_ids(40, 1), max_tokens=6)
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 6 and len(chunks) >= 2
    final = chunks[-1]
    assert final.finished and not any(c.finished for c in chunks[:-1])
    assert (final.finish_reason, final.worker_id) == ("length", stack.worker_id)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (40, 6)
    assert final.usage.cached_tokens == 0 and final.ttft_s > 0


async def test_logprobs_chunks_carry_one_logprob_per_token(stack: Stack) -> None:
    chunks = await stack.generate(random_ids(30, 11), max_tokens=8, logprobs=2)
    assert sum(len(c.token_ids) for c in chunks) == 8
    for c in chunks:
        assert len(c.logprobs) == len(c.token_ids), c
        for lp in c.logprobs:
            assert lp.logprob <= 0 and len(lp.top_ids) == len(lp.top_logprobs) == 2


async def test_a_request_asks_for_fewer_larger_messages(stack: Stack) -> None:
    # The gateway's stream interval: the first token alone (TTFT), then 4 at a time,
    # the last as soon as it is ready; the same tokens as one message per token.
    prompt = random_ids(30, 12)
    coarse = await stack.generate(prompt, max_tokens=10, stream_interval=4)
    fine = await stack.generate(prompt, max_tokens=10)
    sizes = [len(c.token_ids) for c in coarse]
    # (A loaded machine may merge more: the first may carry 2, a middle one more than 4.)
    assert sum(sizes) == 10 and all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 4, sizes
    assert len(fine) > len(coarse)
    assert [t for c in coarse for t in c.token_ids] == [t for c in fine for t in c.token_ids]
    assert coarse[-1].finished and coarse[-1].usage.completion_tokens == 10


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


async def test_a_prompt_sent_as_le32_bytes_generates_what_its_varints_do(stack: Stack) -> None:
    prompt = random_ids(70, 11)
    varint = await stack.generate(prompt, max_tokens=6)
    le32 = [
        chunk
        async for chunk in stack.stub.Generate(
            pb.GenerateRequest(
                request_id="r-le32",
                prompt_token_ids_le32=prompt_wire.le32(prompt),
                sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            )
        )
    ]
    assert [t for c in le32 for t in c.token_ids] == [t for c in varint for t in c.token_ids]
    assert le32[-1].usage.prompt_tokens == 70
    assert le32[-1].usage.cached_tokens == (70 // BLOCK) * BLOCK  # the varint run cached it
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids_le32=b"\x05\x00\x00", sampling=pb.SamplingParams(max_tokens=2)
            )
        ).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multiple of 4" in err.value.details()


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


async def test_grpc_over_tls(stack_runner, tmp_path: Path) -> None:
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
    engine = Engine(stack_runner, EngineConfig(), hash_spec=HashSpec(BLOCK, "tiny"))
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
