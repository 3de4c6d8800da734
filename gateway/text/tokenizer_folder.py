"""Finds the gateway's model folder (tokenizer + chat template) on local disk.

The gateway only needs the tokenizer files, never the weights, and must not
import the worker package (torch). ``contract.model_paths`` maps ``--model``
(a folder, a ``.gguf`` file or the alias ``smollm2``) to the folder the
workers load; for an alias or a GGUF that folder exists once a worker has
converted the model. The gateway never converts.
"""

from __future__ import annotations

from pathlib import Path

from contract.model_paths import model_dir_for

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_model_dir(name_or_path: str) -> Path:
    """A local folder with the model's tokenizer for ``--model``; ``ValueError`` if none."""
    path = model_dir_for(name_or_path)
    if path.is_dir() and any((path / name).exists() for name in _TOKENIZER_FILES):
        return path
    if path != Path(name_or_path).expanduser():
        raise ValueError(
            f"--model {name_or_path!r}: {path} does not exist yet; start a worker with "
            f"--model {name_or_path} once (it converts the model), or pass the folder"
        )
    raise ValueError(
        f"--model {name_or_path!r}: not a model folder with a tokenizer, nor the alias 'smollm2' "
        "(models are never downloaded)"
    )
