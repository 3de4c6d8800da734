"""Bad gRPC input straight to a worker: hand-written invalid requests and property-based
sampling values, each answered with INVALID_ARGUMENT (or served) while the engine keeps
running. The gateway's HTTP edge is ``test_bad_input``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from contract import worker_pb2 as pb
from contract import worker_pb2_grpc
from loadtest.fleet import Fleet
from tests.reliability.bad_input_kit import (
    FAST,
    MAX_MODEL_LEN,
    fleet_config,
    generate,
    worker_stub,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stub(
    tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[worker_pb2_grpc.WorkerStub]:
    log_dir = str(tmp_path_factory.mktemp("bad-grpc-logs"))
    with Fleet(fleet_config(tiny_llama, redis_url, "kvbadgrpc", log_dir)) as f, worker_stub(f) as s:
        yield s


def test_grpc_invalid_requests(stub: worker_pb2_grpc.WorkerStub) -> None:
    assert stub.Health(pb.HealthRequest(), timeout=10).serving
    bad: list[tuple[list[int], dict[str, Any]]] = [
        ([], {"max_tokens": 2}),
        ([10**9], {"max_tokens": 2}),
        ([2**32 - 1], {"max_tokens": 2}),
        ([1] * (MAX_MODEL_LEN + 1), {"max_tokens": 1}),
        ([1, 2], {"max_tokens": MAX_MODEL_LEN}),
        ([1, 2], {"max_tokens": 2, "temperature": math.nan}),
        ([1, 2], {"max_tokens": 2, "temperature": math.inf}),
        ([1, 2], {"max_tokens": 2, "temperature": -1.0}),
        ([1, 2], {"max_tokens": 2, "top_p": math.inf}),
        ([1, 2], {"max_tokens": 2, "top_p": 1.5}),
        ([1, 2], {"max_tokens": 2, "stop_token_ids": [10**9]}),
    ]
    for prompt, sampling in bad:
        assert generate(stub, prompt, **sampling) == "INVALID_ARGUMENT", (prompt[:3], sampling)
    assert generate(stub, [1, 2, 3], max_tokens=3) == "OK"
    assert stub.Health(pb.HealthRequest(), timeout=10).serving


@settings(FAST, max_examples=300)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=8),
    max_tokens=st.integers(min_value=0, max_value=2**32 - 1),
    temperature=st.floats(width=32),
    top_p=st.floats(width=32),
    top_k=st.integers(min_value=0, max_value=2**32 - 1),
    seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)),
)
def test_grpc_sampling_property(
    stub: worker_pb2_grpc.WorkerStub,
    prompt: list[int],
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
) -> None:
    """Any wire values: the call finishes or is INVALID_ARGUMENT, and the engine lives on."""
    sampling: dict[str, Any] = {
        "max_tokens": min(max_tokens, 4) if max_tokens % 3 else max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }
    if seed is not None:
        sampling["seed"] = seed
    outcome = generate(stub, prompt, **sampling)
    assert outcome in ("OK", "INVALID_ARGUMENT"), (outcome, prompt, sampling)
    assert generate(stub, [1, 2, 3], max_tokens=2) == "OK", (prompt, sampling)
