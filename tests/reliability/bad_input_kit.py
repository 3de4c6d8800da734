"""What the bad-input tests share: one small fleet's settings, hypothesis settings, gRPC calls.

The worker runs with ``--max-model-len 96`` (``MAX_MODEL_LEN``) so generated
requests that are valid stay cheap (at most 96 tokens); the gateway refuses
bodies over ``MAX_BODY`` and cuts idle or slow clients after
``CLIENT_TIMEOUT_S``. ``test_bad_input`` sends bad HTTP requests to the
gateway, ``test_bad_grpc_input`` bad gRPC requests straight to the worker; each
starts its own fleet from ``fleet_config``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from hypothesis import HealthCheck, settings

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from loadtest.fleet import Fleet, FleetConfig

MAX_MODEL_LEN = 96
MAX_BODY = 64 * 1024
CLIENT_TIMEOUT_S = 2.0  # the gateway's idle/header and body timeouts here
FAST = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def fleet_config(model: Path, redis_url: str, namespace: str, log_dir: str) -> FleetConfig:
    """One worker and the gateway, with the limits above."""
    return FleetConfig(
        model=str(model),
        workers=1,
        redis_url=redis_url,
        namespace=namespace,
        num_blocks=256,
        worker_args=("--max-model-len", str(MAX_MODEL_LEN), "--log-level", "WARNING"),
        gateway_args=(
            "--max-body-bytes",
            str(MAX_BODY),
            "--log-level",
            "warning",
            "--client-idle-timeout",
            str(CLIENT_TIMEOUT_S),
            "--client-body-timeout",
            str(CLIENT_TIMEOUT_S),
        ),
        log_dir=log_dir,
    )


@contextlib.contextmanager
def worker_stub(fleet: Fleet) -> Iterator[worker_pb2_grpc.WorkerStub]:
    """A gRPC stub of the fleet's one worker, over a plain channel."""
    with grpc.insecure_channel(f"127.0.0.1:{fleet.workers[0].grpc_port}") as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def generate(stub: worker_pb2_grpc.WorkerStub, prompt: list[int], **sampling: Any) -> str:
    """The status name of one Generate call, read to the end ("OK" when it finished)."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling))
    try:
        responses = list(stub.Generate(request, timeout=30))
    except grpc.RpcError as exc:
        return exc.code().name
    assert responses and responses[-1].finished
    return "OK"
