"""Where a model's local folder is, so gateway and workers load the very same tokenizer.

The gateway tokenizes exactly as the workers do only if both read the same
tokenizer files. ``--model`` on either side may be a folder, a ``.gguf`` file
or the alias ``smollm2``; this module maps each to one folder path. It never
converts or downloads: the worker converts a GGUF once (``worker.model.store``)
into the folder named here, and the gateway waits for or reads that folder.
"""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where converted models live (``KVROUTE_CACHE_DIR``, else ``~/.cache/kvroute``)."""
    root = os.environ.get("KVROUTE_CACHE_DIR") or Path.home() / ".cache" / "kvroute"
    return Path(root) / "models"


def is_smollm2_alias(name: str) -> bool:
    return name.lower() in (SMOLLM2_ALIAS, SMOLLM2_NAME.lower())


def model_dir_for(name_or_path: str) -> Path:
    """The HF folder ``--model`` refers to (it may not exist yet for an alias or GGUF)."""
    if is_smollm2_alias(name_or_path):
        return cache_dir() / SMOLLM2_NAME
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return cache_dir() / path.stem
    return path


def served_model_name(name_or_path: str) -> str:
    """The default model id a fleet serves and hashes with: the folder's name.

    Computed from the argument alone (a .gguf is not converted just to name it).
    """
    return model_dir_for(name_or_path).resolve().name
