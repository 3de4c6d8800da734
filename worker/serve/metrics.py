"""Prometheus metrics of one worker, in a registry of its own (never the global one).

Two sources, one exposition:

- engine counters and gauges (tokens, blocks, running/waiting, evictions) are
  read from ``engine.stats()`` at scrape time by ``_EngineCollector``, so they
  are exactly what the engine counted and cost nothing between scrapes;
- latency histograms and requests by ``finish_reason`` are observed from the
  engine's ``on_request_finished`` hook, with engine-side timestamps of every
  token, whichever server (gRPC or HTTP) the request came through. A request
  the HTTP front cuts at a stop string is aborted in the engine and counts as
  ``abort`` there.

Names are the contract with ``deploy/`` dashboards (``docs/INTERFACES.md``);
every ``kvroute_worker_*`` series carries ``worker_id`` (the gateway uses the
same label), each gauge has one unit, and ``kvroute_worker_blocks{state}``
partitions the pool (``used + free`` is the capacity; how many blocks hold
reusable KV, in use or not, is the separate ``kvroute_worker_cached_blocks``).
The standard ``process_*`` metrics come along; with ``vllm_aliases`` the
fleet-level counters are also exported under vLLM's names (``vllm:*``,
labelled ``model_name``), so vLLM dashboards and inference-perf read them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")
BLOCK_STATES = ("used", "free")  # a partition: they add up to the pool's capacity

# Every name in docs/INTERFACES.md; tests check the exposition against this tuple.
METRIC_NAMES = (
    "kvroute_worker_prompt_tokens_total",
    "kvroute_worker_cached_prompt_tokens_total",
    "kvroute_worker_generation_tokens_total",
    "kvroute_worker_requests_total",
    "kvroute_worker_preemptions_total",
    "kvroute_worker_evictions_total",
    "kvroute_worker_blocks",
    "kvroute_worker_block_capacity",
    "kvroute_worker_cached_blocks",
    "kvroute_worker_pinned_blocks",
    "kvroute_worker_running",
    "kvroute_worker_waiting",
    "kvroute_worker_queued_prefill_tokens",
    "kvroute_worker_ttft_seconds",
    "kvroute_worker_inter_token_latency_seconds",
    "kvroute_worker_e2e_seconds",
)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# (metric name without _total, EngineStats field, help)
_ENGINE_COUNTERS = (
    ("kvroute_worker_prompt_tokens", "prompt_tokens_total", "Prompt tokens admitted."),
    (
        "kvroute_worker_cached_prompt_tokens",
        "cached_prompt_tokens_total",
        "Prompt tokens served from cached full blocks (engine-reported).",
    ),
    ("kvroute_worker_generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("kvroute_worker_preemptions", "preemptions_total", "Sequences preempted for recompute."),
    ("kvroute_worker_evictions", "evictions_total", "Cached blocks evicted for reuse."),
)
_ENGINE_GAUGES = (
    ("kvroute_worker_block_capacity", "num_blocks", "KV blocks in the pool."),
    (
        "kvroute_worker_cached_blocks",
        "cached_blocks",
        "KV blocks holding a reusable hashed block, in use or free.",
    ),
    ("kvroute_worker_pinned_blocks", "pinned_blocks", "KV blocks pinned (never evicted)."),
    ("kvroute_worker_running", "running", "Sequences running."),
    ("kvroute_worker_waiting", "waiting", "Sequences waiting for admission."),
    (
        "kvroute_worker_queued_prefill_tokens",
        "queued_prefill_tokens",
        "Prompt tokens not yet computed.",
    ),
)


class StatsSource(Protocol):
    def stats(self) -> Any: ...


# vLLM's names for the same figures: (vLLM name without _total, kind, EngineStats field, help).
_VLLM_ALIASES = (
    ("vllm:prompt_tokens", "counter", "prompt_tokens_total", "Prompt tokens processed."),
    ("vllm:generation_tokens", "counter", "generation_tokens_total", "Generation tokens."),
    (
        "vllm:prefix_cache_queries",
        "counter",
        "prompt_tokens_total",
        "Prefix cache queries, in tokens.",
    ),
    (
        "vllm:prefix_cache_hits",
        "counter",
        "cached_prompt_tokens_total",
        "Prefix cache hits, in tokens.",
    ),
    ("vllm:num_preemptions", "counter", "preemptions_total", "Preemptions."),
    ("vllm:num_requests_running", "gauge", "running", "Requests running."),
    ("vllm:num_requests_waiting", "gauge", "waiting", "Requests waiting."),
)


class _EngineCollector(Collector):
    """Reads ``engine.stats()`` at each scrape."""

    def __init__(
        self, engine: StatsSource, worker_id: str, vllm_model_name: str | None = None
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.vllm_model_name = vllm_model_name  # None = no vllm:* aliases

    def describe(self) -> list[Metric]:
        # Names only, so registering does not call into the engine.
        out: list[Metric] = [
            CounterMetricFamily(n, h, labels=["worker_id"]) for n, _, h in _ENGINE_COUNTERS
        ]
        out += [GaugeMetricFamily(n, h, labels=["worker_id"]) for n, _, h in _ENGINE_GAUGES]
        out.append(
            GaugeMetricFamily(
                "kvroute_worker_blocks", "KV blocks by state.", labels=["worker_id", "state"]
            )
        )
        return out + list(self._aliases(None))

    def _aliases(self, stats: Any) -> Iterator[Metric]:
        if self.vllm_model_name is None:
            return
        labels = ["model_name", "worker_id"]
        values = [self.vllm_model_name, self.worker_id]
        for name, kind, field_name, text in _VLLM_ALIASES:
            family: Metric
            if kind == "counter":
                family = CounterMetricFamily(name, text, labels=labels)
            else:
                family = GaugeMetricFamily(name, text, labels=labels)
            if stats is not None:
                family.add_metric(values, float(getattr(stats, field_name)))
            yield family
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", labels=labels
        )
        if stats is not None:
            usage.add_metric(
                values, stats.used_blocks / stats.num_blocks if stats.num_blocks else 0.0
            )
        yield usage

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        wid = [self.worker_id]
        for name, field_name, text in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(name, text, labels=["worker_id"])
            counter.add_metric(wid, float(getattr(stats, field_name)))
            yield counter
        for name, field_name, text in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["worker_id"])
            gauge.add_metric(wid, float(getattr(stats, field_name)))
            yield gauge
        blocks = GaugeMetricFamily(
            "kvroute_worker_blocks", "KV blocks by state.", labels=["worker_id", "state"]
        )
        values = {"used": stats.used_blocks, "free": stats.free_blocks}
        for state in BLOCK_STATES:
            blocks.add_metric([self.worker_id, state], float(values[state]))
        yield blocks
        yield from self._aliases(stats)


class WorkerMetrics:
    """The metrics of one worker; ``render()`` is the ``/metrics`` body."""

    def __init__(
        self, engine: StatsSource, worker_id: str, vllm_model_name: str | None = None
    ) -> None:
        """``vllm_model_name``: also export the ``vllm:*`` aliases, labelled with this name."""
        self.worker_id = worker_id
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        labels = ["worker_id"]
        self.requests = Counter(
            "kvroute_worker_requests",
            "Requests finished, by reason.",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvroute_worker_ttft_seconds",
            "Engine-side time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvroute_worker_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvroute_worker_e2e_seconds",
            "Request arrival to last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.frames_connections = Counter(
            "kvroute_worker_frames_connections",
            "Gateway connections accepted on the frames port (--frames-port).",
            labels,
            registry=self.registry,
        )
        # Children exist from the start, so every series is visible at zero.
        self.frames_connections.labels(worker_id)
        for reason in FINISH_REASONS:
            self.requests.labels(worker_id, reason)
        self._ttft = self.ttft.labels(worker_id)
        self._itl = self.itl.labels(worker_id)
        self._e2e = self.e2e.labels(worker_id)
        self.registry.register(_EngineCollector(engine, worker_id, vllm_model_name))
        add_listener = getattr(engine, "add_finished_listener", None)
        if add_listener is not None:
            add_listener(self.on_request_finished)

    def on_request_finished(self, output: Any, timings: Any) -> None:
        """Engine hook (engine thread): one finished request's reason and latencies."""
        self.requests.labels(self.worker_id, output.finish_reason or "stop").inc()
        if timings.ttft_s is not None:
            self._ttft.observe(timings.ttft_s)
        for gap in timings.inter_token_latencies_s:
            self._itl.observe(gap)
        self._e2e.observe(timings.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
