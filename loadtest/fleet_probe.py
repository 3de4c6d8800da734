"""What a benchmark asks a running fleet's workers over HTTP, outside the workload.

The served model (``/v1/models``), the prompt and cached-prompt token counters
from each worker's ``/metrics`` (kvroute's names or vLLM's) and their deltas
over a run, and one warm-up request per worker. Used by ``bench_fleet``,
``bench_peers`` and ``peers_matrix``.
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from collections.abc import Sequence
from typing import Any

from loadtest import stats

_COUNTER_RE = re.compile(
    r"^(kvroute_worker_(?:cached_)?prompt_tokens_total|vllm:prompt_tokens(?:_cached)?_total)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)$",
    re.M,
)


_TTFT_RE = re.compile(
    r"^kvroute_worker_ttft_seconds_(sum|count)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M
)


def worker_ttft_totals(worker_urls: Sequence[str]) -> tuple[float, float]:
    """Engine-side TTFT over the fleet: (seconds summed, requests), from each kvroute
    worker's ``kvroute_worker_ttft_seconds`` histogram (engine arrival to first token)."""
    total = count = 0.0
    for url in worker_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            seconds, requests = parse_worker_ttft(resp.read().decode())
        total += seconds
        count += requests
    return total, count


def parse_worker_ttft(text: str) -> tuple[float, float]:
    """(seconds summed, requests) of the TTFT histogram in one worker's ``/metrics``."""
    totals = {"sum": 0.0, "count": 0.0}
    for kind, value in _TTFT_RE.findall(text):
        totals[kind] += float(value)
    return totals["sum"], totals["count"]


def worker_ttft_mean(
    before: tuple[float, float], after: tuple[float, float], time_scale: float = 1.0
) -> float:
    """Mean engine-side TTFT between two ``worker_ttft_totals`` readings, in emulated units."""
    requests = after[1] - before[1]
    return (after[0] - before[0]) / requests / time_scale if requests > 0 else math.nan


_GATEWAY_RE = re.compile(
    r"^kvroute_gateway_(prompt_tokens|predicted_cached_tokens|cached_tokens|requests)_total"
    r"(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$",
    re.M,
)
_REASON_RE = re.compile(r'reason="([a-z]+)"')
_GATEWAY_TIMES_RE = re.compile(
    r"^kvroute_gateway_(routing|ttft)_seconds_(sum|count)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M
)


def gateway_counters(gateway_urls: Sequence[str]) -> dict[str, float]:
    """kvroute gateways' routing counters, summed over ``gateway_urls`` (replicas):
    prompt tokens routed, the tokens the index predicted cached, the tokens the workers
    reported cached, and requests per routing reason (``requests:REASON``)."""
    out: dict[str, float] = {}
    for url in gateway_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            parse_gateway_counters(resp.read().decode(), out)
    return out


def parse_gateway_counters(text: str, into: dict[str, float]) -> dict[str, float]:
    """Adds one gateway's ``/metrics`` counters (``gateway_counters``' keys) to ``into``."""
    for name, labels, value in _GATEWAY_RE.findall(text):
        if name == "requests":
            reason = _REASON_RE.search(labels or "")
            name = f"requests:{reason.group(1) if reason else 'unknown'}"
        into[name] = into.get(name, 0.0) + float(value)
    for name, kind, value in _GATEWAY_TIMES_RE.findall(text):
        key = f"{name}_seconds_{kind}"
        into[key] = into.get(key, 0.0) + float(value)
    return into


def gateway_figures(
    before: dict[str, float], after: dict[str, float], time_scale: float = 1.0
) -> dict[str, Any]:
    """What the gateways predicted over a run against what the workers then reported, and
    their mean routing time (parse to choice) and TTFT (arrival to first token), both in
    emulated units (divided by ``time_scale``)."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    prompt = delta.get("prompt_tokens", 0.0)
    ratio = (lambda k: delta.get(k, 0.0) / prompt) if prompt else (lambda k: math.nan)

    def mean_s(name: str) -> float:
        count = delta.get(f"{name}_seconds_count", 0.0)
        return delta.get(f"{name}_seconds_sum", 0.0) / count / time_scale if count else math.nan

    return {
        "predicted_hit_rate": ratio("predicted_cached_tokens"),
        "reported_hit_rate": ratio("cached_tokens"),
        "routing_mean_s": mean_s("routing"),
        "ttft_mean_s": mean_s("ttft"),
        "reasons": {
            k.split(":", 1)[1]: int(v)
            for k, v in sorted(delta.items())
            if k.startswith("requests:")
        },
    }


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def served_model(base_url: str) -> str:
    """The model id an OpenAI endpoint serves (first entry of /v1/models)."""
    return str(get_json(f"{base_url}/v1/models")["data"][0]["id"])


def worker_counters(worker_urls: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``(prompt_tokens, cached_prompt_tokens)`` counters from each worker's /metrics."""
    out = {}
    for url in worker_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        values: dict[str, float] = {}
        for name, value in _COUNTER_RE.findall(text):
            values[name] = values.get(name, 0.0) + float(value)
        out[url] = (  # a vLLM worker reports the same two counters under its own names
            values.get(
                "kvroute_worker_prompt_tokens_total", values.get("vllm:prompt_tokens_total", 0.0)
            ),
            values.get(
                "kvroute_worker_cached_prompt_tokens_total",
                values.get("vllm:prompt_tokens_cached_total", 0.0),
            ),
        )
    return out


def counters_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """Prompt/cached token deltas per worker and the fleet's hit rate over them."""
    per = {url: (after[url][0] - before[url][0], after[url][1] - before[url][1]) for url in after}
    prompt = sum(p for p, _ in per.values())
    cached = sum(c for _, c in per.values())
    return {
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "hit_rate": cached / prompt if prompt else math.nan,
        "prompt_share": stats.load_share({url: p for url, (p, _) in per.items()}),
    }


def warm_up(worker_urls: Sequence[str], model: str) -> None:
    """One short request per worker, straight to its HTTP front, with a prompt nobody reuses.

    The first forward pass of a fresh process pays one-off costs (allocations,
    kernel selection) that would otherwise land on whichever turn-1 request
    reaches that worker first.
    """
    for i, url in enumerate(worker_urls):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"warm up number {i}: say hello"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
