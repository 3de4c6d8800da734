"""The worker as a whole: Redis dying and coming back, the real SmolLM2, the real command.

The last test runs ``kvroute worker`` in a subprocess and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import grpc
import pytest
import redis
import redis.asyncio as aioredis

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from contract.redis_layout import RedisLayout, WorkerRecord, decode_block_set
from tests.support import RedisProcess, free_port, wait_until
from tests.worker.server_stack import BLOCK, Stack, random_ids

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


async def test_killing_redis_does_not_fail_requests_and_restart_restores_state(
    stack_runner, stack_tokenizer, redis_process: RedisProcess
) -> None:
    s = await Stack(stack_runner, stack_tokenizer, redis_process.url).start()
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
