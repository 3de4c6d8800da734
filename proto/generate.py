"""Regenerates the Python gRPC/protobuf stubs in ``contract/`` from ``proto/*.proto``.

Run ``python proto/generate.py`` (or ``make proto``) after editing a .proto file;
``tests/contract/test_stubs.py`` fails while the committed stubs are stale.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("worker.proto", "kv_events.proto")


def generate(out_dir: Path) -> list[Path]:
    """Compiles every proto into ``out_dir``, with imports made package-relative."""
    from grpc_tools import protoc  # dev-only dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(PROTO_DIR / name) for name in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = sorted(out_dir.glob("*_pb2*.py*"))
    for path in written:
        text = path.read_text()
        # protoc writes `import worker_pb2`; the stubs live in the `contract` package.
        text = re.sub(r"^import (\w+_pb2) as", r"from contract import \1 as", text, flags=re.M)
        path.write_text(text)
    return written


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR.parent / "contract"
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (target / path.name).write_text(path.read_text())
            print(f"wrote {target / path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
