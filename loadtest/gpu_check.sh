#!/usr/bin/env bash
# GPU check for kvroute's engine, for a machine with CUDA (none is needed anywhere else).
#
#   bash loadtest/gpu_check.sh [OUT_DIR]
#
# 1. the engine correctness tests (paged runner vs Hugging Face logits and
#    generate, the real engine cold / prefix hit / mixed batch, the sampler)
#    with KVROUTE_TEST_DEVICE=cuda, so every ModelRunner in them runs on the GPU;
# 2. loadtest.bench_engine in-process on cuda, bf16 (TTFT cold and with a
#    prefix hit, 8 x 256 greedy tokens, outputs compared with HF generate).
#
# Prints one JSON object: {"device", "tests_passed", "tests_rc", "bench": {...}}; the
# pytest log and the bench JSON are kept in OUT_DIR (default gpu-check-out/).
# Needs the repo's .venv with a CUDA build of torch (PYTHON=... to use another interpreter)
# and the SmolLM2 folder (worker.model.store downloads it when online).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${1:-gpu-check-out}"
mkdir -p "$OUT"

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo '{"error": "torch.cuda.is_available() is false: run this on a CUDA machine"}'
    exit 2
fi
DEVICE_NAME="$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")"

# Capacity-from-memory-fraction fakes host RAM, which a CUDA runner never reads.
KVROUTE_TEST_DEVICE=cuda timeout 1200 "$PYTHON" -m pytest -q -x \
    tests/worker/test_model_runner.py tests/worker/test_engine_real_model.py \
    tests/worker/test_sampler.py -k "not capacity_from_memory_fraction" \
    >"$OUT/pytest.log" 2>&1
TESTS_RC=$?

timeout 1200 "$PYTHON" -m loadtest.bench_engine --device cuda --dtype bfloat16 \
    >"$OUT/bench_engine.json" 2>"$OUT/bench_engine.err"
BENCH_RC=$?

"$PYTHON" - "$OUT" "$TESTS_RC" "$BENCH_RC" "$DEVICE_NAME" <<'EOF'
import json, pathlib, sys
out, tests_rc, bench_rc, name = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    bench = json.loads((out / "bench_engine.json").read_text())
except ValueError:
    bench = {"error": f"bench_engine exited {bench_rc}", "stderr_tail": (out / "bench_engine.err").read_text()[-2000:]}
tail = (out / "pytest.log").read_text().strip().splitlines()[-1:] or [""]
print(json.dumps({"device": name, "tests_passed": tests_rc == 0, "tests_rc": tests_rc,
                  "tests_summary": tail[0], "bench_rc": bench_rc, "bench": bench}, indent=2))
EOF
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
