"""Finds the gateway's model folder (tokenizer + chat template) on local disk.

The gateway only needs the tokenizer files, never the weights, and must not
import the worker package (torch). The ``smollm2`` alias therefore resolves
only to the folder a worker already converted into the shared cache dir
(``KVROUTE_CACHE_DIR``, else ``~/.cache/kvroute``); the gateway never converts.
"""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def models_cache_dir() -> Path:
    """The folder workers convert models into (same rule as the worker's model store)."""
    root = os.environ.get("KVROUTE_CACHE_DIR") or Path.home() / ".cache" / "kvroute"
    return Path(root) / "models"


def resolve_model_dir(name_or_path: str) -> Path:
    """A local folder with the model's tokenizer for ``--model``; ``ValueError`` if none."""
    if name_or_path.lower() in SMOLLM2_ALIASES:
        path = models_cache_dir() / SMOLLM2_NAME
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise ValueError(
                f"--model {name_or_path!r}: {path} does not exist yet; start a worker with "
                "--model smollm2 once (it converts the model), or pass the folder"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (
        (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    ):
        return path
    raise ValueError(
        f"--model {name_or_path!r}: not a model folder with a tokenizer, nor the alias 'smollm2' "
        "(models are never downloaded)"
    )
