"""The gateway (and the contract) must run where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every gateway module is imported in a fresh interpreter where torch is hidden, so a stray import anywhere in the gateway is caught.
_PROBE = """
import importlib, pkgutil, sys
# A None entry makes `import torch` raise ImportError and find_spec("torch")
# return None, exactly as on a machine where torch is not installed.
sys.modules["torch"] = None
import contract, gateway
names = ["contract", "gateway"]
for pkg in (contract, gateway):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        names.append(info.name)
for name in names:
    importlib.import_module(name)
assert sys.modules["torch"] is None
print(len(names))
"""


def test_gateway_and_contract_import_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 2


def test_cli_help_lists_subcommands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvroute_cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for name in ("gateway", "worker", "up"):
        assert name in result.stdout
