"""inference-perf as a third-party load client: its own venv and its report.

inference-perf (PyPI ``inference-perf``) lives in ``.venv-inference-perf``,
installed on first use, never in the project's venv; it declares Python >= 3.12
(``python_312`` finds one, else a 3.11 venv takes the unchanged wheel).
``inference_perf_counts`` reads the successes and failures from its
``summary_lifecycle_metrics.json``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

INFERENCE_PERF_VERSION = "0.7.0"


def inference_perf_counts(summary: dict[str, Any]) -> tuple[int, int]:
    """(successful, failed) requests of inference-perf's ``summary_lifecycle_metrics.json``."""
    return int(summary["successes"]["count"]), int(summary["failures"]["count"])


def python_312() -> str | None:
    """A Python >= 3.12 that runs: python3.13/python3.12 on PATH, or one pyenv installed."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [shutil.which(name) for name in ("python3.12", "python3.13")]
    found += [str(p) for p in sorted(pyenv.glob("3.1[2-9]*/bin/python3"))]
    check = "import sys; sys.exit(sys.version_info < (3, 12))"
    for python in filter(None, found):
        # pyenv puts shims on PATH for versions it has but has not selected: they fail.
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if (
                subprocess.run([python, "-c", check], capture_output=True, timeout=30).returncode
                == 0
            ):
                return python
    return None


def ensure_inference_perf(venv: Path) -> tuple[Path, str]:
    """inference-perf's executable in ``venv``, installed on first use; and its interpreter.

    inference-perf declares Python >= 3.12, so the venv is made with ``python_312()``.
    Where there is none, the unchanged wheel goes into a 3.11 venv with
    ``--no-deps --ignore-requires-python`` and its declared dependencies are installed
    normally (each still meets its own Python floor); the note says so.
    """
    exe, done = venv / "bin" / "inference-perf", venv / ".kvroute-installed"
    if exe.exists() and done.exists():
        return exe, done.read_text().strip()
    python = python_312()
    note = "" if python else "Python 3.11 with --ignore-requires-python (declares >= 3.12)"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python or sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    spec = f"inference-perf=={INFERENCE_PERF_VERSION}"
    if python:
        subprocess.run([*pip, spec], check=True, timeout=1800)
    else:
        subprocess.run(
            [*pip, "--no-deps", "--ignore-requires-python", spec], check=True, timeout=600
        )
        list_deps = (
            "import importlib.metadata as m; "
            "print('\\n'.join(r for r in m.requires('inference-perf') or [] if 'extra ==' not in r))"
        )
        deps = subprocess.run(
            [str(venv / "bin" / "python"), "-c", list_deps],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split("\n")
        subprocess.run([*pip, *[d for d in deps if d.strip()]], check=True, timeout=1800)
    done.write_text(note + "\n")  # only now: a half-installed venv is installed again
    return exe, note
