"""The committed gRPC/protobuf stubs match proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = module.generate(tmp_path)
    assert {p.name for p in generated} >= {
        "worker_pb2.py",
        "worker_pb2_grpc.py",
        "kv_events_pb2.py",
    }
    for path in generated:
        committed = ROOT / "contract" / path.name
        assert committed.exists(), f"{committed} missing: run make proto"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run make proto"
        )


def test_stubs_import() -> None:
    from contract import kv_events_pb2, worker_pb2, worker_pb2_grpc

    assert worker_pb2.GenerateRequest(prompt_token_ids=[1, 2]).prompt_token_ids == [1, 2]
    assert hasattr(worker_pb2_grpc, "WorkerStub")
    assert kv_events_pb2.EventBatch(seq=3).seq == 3
