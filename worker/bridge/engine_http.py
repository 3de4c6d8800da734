"""What the bridge asks the engine over HTTP: health, served model, load, tokenization.

vLLM's OpenAI server answers all of it: ``/health``, ``/v1/models``,
``/metrics`` (Prometheus text) and ``/tokenize`` (with ``messages`` it
renders the chat template itself). ``parse_metrics`` is a pure function so
the load mapping is tested without a server.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


@dataclass(frozen=True)
class EngineLoad:
    """One scrape of the engine's ``/metrics``; counters are cumulative since its boot."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_blocks: int = 0
    block_size: int = 0
    prompt_tokens: float = 0.0
    cached_prompt_tokens: float = 0.0
    prefill_seconds: float = 0.0
    generation_tokens: float = 0.0
    decode_seconds: float = 0.0

    @property
    def free_blocks(self) -> int:
        return max(0, round(self.num_blocks * (1.0 - self.kv_usage)))


def _labels(raw: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in raw.split('",'):
        key, sep, value = part.partition('="')
        if sep:
            out[key.strip().lstrip(",")] = value.rstrip('"')
    return out


def parse_metrics(text: str) -> EngineLoad:
    """vLLM's Prometheus text -> ``EngineLoad`` (summed over engines/models; missing = 0)."""
    sums: dict[str, float] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isnan(number):
            continue
        if name == "vllm:cache_config_info":
            info = _labels(labels.rstrip("}"))
            continue
        sums[name] = sums.get(name, 0.0) + number

    def _int(key: str) -> int:
        try:
            return int(info.get(key, "") or 0)
        except ValueError:
            return 0

    return EngineLoad(
        running=int(sums.get("vllm:num_requests_running", 0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0)),
        kv_usage=min(1.0, max(0.0, sums.get("vllm:kv_cache_usage_perc", 0.0))),
        num_blocks=_int("num_gpu_blocks_override") or _int("num_gpu_blocks"),
        block_size=_int("block_size"),
        prompt_tokens=sums.get("vllm:prompt_tokens_total", 0.0),
        cached_prompt_tokens=sums.get("vllm:prompt_tokens_cached_total", 0.0),
        prefill_seconds=sums.get("vllm:request_prefill_time_seconds_sum", 0.0),
        generation_tokens=sums.get("vllm:generation_tokens_total", 0.0),
        decode_seconds=sums.get("vllm:request_decode_time_seconds_sum", 0.0),
    )


class RateMeter:
    """Prefill and decode tokens/s from successive scrapes (an EWMA; 0 until measured)."""

    def __init__(self, alpha: float = 0.3, min_busy_s: float = 0.2) -> None:
        self.alpha = alpha
        self.min_busy_s = min_busy_s
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        self._last: EngineLoad | None = None

    def update(self, load: EngineLoad) -> None:
        last, self._last = self._last, load
        if last is None or load.prompt_tokens < last.prompt_tokens:  # first scrape, or a restart
            return
        busy = load.prefill_seconds - last.prefill_seconds
        if busy >= self.min_busy_s:
            tokens = (load.prompt_tokens - load.cached_prompt_tokens) - (
                last.prompt_tokens - last.cached_prompt_tokens
            )
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, tokens / busy)
        busy = load.decode_seconds - last.decode_seconds
        if busy >= self.min_busy_s:
            tokens = load.generation_tokens - last.generation_tokens
            self.decode_tokens_per_s = self._ewma(self.decode_tokens_per_s, tokens / busy)

    def _ewma(self, old: float, new: float) -> float:
        return new if old <= 0 else (1 - self.alpha) * old + self.alpha * new


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int


class EngineHTTP:
    """A small client for the engine's own HTTP API."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/")
        self.session = session

    async def healthy(self) -> bool:
        """True when ``/health`` answers 200."""
        try:
            async with self.session.get(f"{self.url}/health", timeout=_TIMEOUT) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def served_model(self) -> ServedModel:
        """The first model ``/v1/models`` lists (vLLM serves one)."""
        body = await self._get_json("/v1/models")
        data = body.get("data") or []
        if not data:
            raise ValueError(f"{self.url}/v1/models lists no model")
        return ServedModel(str(data[0]["id"]), int(data[0].get("max_model_len") or 0))

    async def load(self) -> EngineLoad:
        async with self.session.get(f"{self.url}/metrics", timeout=_TIMEOUT) as resp:
            resp.raise_for_status()
            return parse_metrics(await resp.text())

    async def tokenize_chat(self, model: str, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The engine's own rendering + encoding of a chat (generation prompt added)."""
        body = {"model": model, "messages": [dict(m) for m in messages]}
        body["add_generation_prompt"] = True  # type: ignore[assignment]
        return await self._tokens(body)

    async def tokenize_text(self, model: str, text: str) -> list[int]:
        return await self._tokens({"model": model, "prompt": text, "add_special_tokens": False})

    async def _tokens(self, body: Mapping[str, Any]) -> list[int]:
        async with self.session.post(f"{self.url}/tokenize", json=body, timeout=_TIMEOUT) as resp:
            resp.raise_for_status()
            data = await resp.json()
        return [int(t) for t in data["tokens"]]

    async def _get_json(self, path: str) -> dict[str, Any]:
        async with self.session.get(f"{self.url}{path}", timeout=_TIMEOUT) as resp:
            resp.raise_for_status()
            data = await resp.json()
        if not isinstance(data, dict):
            raise ValueError(f"{self.url}{path} did not answer a JSON object")
        return data
