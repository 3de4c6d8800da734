"""What the bridge learns about an engine before an epoch: model, block size, capacity.

``EngineDescriber.describe`` also runs the tokenizer agreement check: the
engine's ``/tokenize`` of ``contract.tokenizer_probe``'s chat and text must
equal kvroute's own rendering, or it raises ``TokenizerMismatch`` and the
bridge refuses to register (a gateway would hash other ids than the engine
caches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from contract.hashing import HashSpec
from contract.tokenizer_probe import PROBE_MESSAGES, PROBE_TEXT, fingerprint, probe_ids
from worker.bridge.engine_http import EngineHTTP


class TokenizerMismatch(Exception):
    """The engine tokenizes the probe differently from kvroute's own rendering."""


@dataclass(frozen=True)
class EngineFacts:
    """What the bridge learned about the engine at the start of an epoch."""

    served_name: str
    spec: HashSpec
    num_blocks: int
    max_model_len: int
    tokenizer_fingerprint: str


class EngineDescriber:
    """Reads an engine's facts; kvroute's tokenizer is loaded once, on the first check."""

    def __init__(
        self,
        *,
        block_size: int = 0,
        model_name: str = "",
        tokenizer: str = "",
        tokenizer_loader: Callable[[str], Any] | None = None,
    ) -> None:
        self.block_size = block_size  # 0 = the engine's, from /metrics
        self.model_name = model_name  # "" = the engine's served name
        self.tokenizer = tokenizer  # "" = the engine's served name
        self._load_tokenizer = tokenizer_loader or auto_tokenizer
        self._kvroute_probe: tuple[list[int], list[int]] | None = None

    async def describe(self, http: EngineHTTP) -> EngineFacts:
        """Served model, block size, capacity and the tokenizer agreement check."""
        served = await http.served_model()
        load = await http.load()
        block_size = self.block_size or load.block_size
        if block_size <= 0:
            raise ValueError("the engine's block size is unknown; pass --block-size")
        try:
            chat = await http.tokenize_chat(served.name, PROBE_MESSAGES)
        except aiohttp.ClientResponseError as exc:
            if exc.status != 400:
                raise
            chat = []  # the engine has no chat template (a base model)
        text = await http.tokenize_text(served.name, PROBE_TEXT)
        ours = self._kvroute_probe_ids(served.name)
        if (chat, text) != ours:
            first = next(
                (i for i, (a, b) in enumerate(zip(chat, ours[0], strict=False)) if a != b),
                min(len(chat), len(ours[0])),
            )
            raise TokenizerMismatch(
                f"refusing to register: the engine at {http.url} tokenizes the probe chat "
                f"differently from kvroute's tokenizer {self.tokenizer or served.name!r} "
                f"(engine {len(chat)} ids, kvroute {len(ours[0])}, first difference at {first}; "
                f"text probe {'equal' if text == ours[1] else 'differs'}). Serve the same "
                "tokenizer and chat template on both sides."
            )
        spec = HashSpec(block_size=block_size, model=self.model_name or served.name)
        return EngineFacts(
            served_name=served.name,
            spec=spec,
            num_blocks=load.num_blocks,
            max_model_len=served.max_model_len,
            tokenizer_fingerprint=fingerprint(chat, text),
        )

    def _kvroute_probe_ids(self, served_name: str) -> tuple[list[int], list[int]]:
        if self._kvroute_probe is None:
            tokenizer = self._load_tokenizer(self.tokenizer or served_name)
            self._kvroute_probe = probe_ids(tokenizer)
        return self._kvroute_probe


def auto_tokenizer(name_or_path: str) -> Any:
    """kvroute's own tokenizer for a model name or folder (``contract.model_paths`` rules)."""
    from transformers import AutoTokenizer  # heavy: only when a bridge starts

    from contract.model_paths import model_dir_for

    return AutoTokenizer.from_pretrained(str(model_dir_for(name_or_path)))
