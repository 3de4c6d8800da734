"""The gateway's Prometheus metrics, on a registry of its own (names per docs/INTERFACES.md).

Per-worker series carry ``worker_id``, the label name the workers use too; each
gauge has one unit (no ``kind`` label mixing requests, tokens and blocks). The
standard ``process_*`` metrics come along. With ``vllm_model_name`` set, the
fleet-level figures are also exported under vLLM's names (``vllm:*``, summed
over workers, labelled ``model_name``), so dashboards and load generators built
for vLLM (inference-perf, vLLM's Grafana board) read a kvroute gateway as is.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.observe.loop_lag import GC_BUCKETS, LAG_BUCKETS

_ROUTING_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WORKER = "worker_id"
# The router's view of each worker, one gauge per figure: (name suffix, help).
WORKER_GAUGES = (
    ("running", "Sequences running on the worker (heartbeat, corrected by this gateway)"),
    ("waiting", "Sequences waiting on the worker (heartbeat, corrected by this gateway)"),
    ("queued_prefill_tokens", "Prompt tokens queued on the worker, not yet computed"),
    ("inflight", "Requests this gateway has open on the worker"),
    ("free_blocks", "KV blocks free on the worker (heartbeat)"),
    ("num_blocks", "KV blocks in the worker's pool (registry)"),
)


class GatewayMetrics:
    """Every ``kvroute_gateway_*`` series; one instance per app."""

    def __init__(self, vllm_model_name: str | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        p = "kvroute_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests routed (counted at their first token), by worker and reason",
            [WORKER, "reason"],
            registry=r,
        )
        self.responses = Counter(
            p + "responses", "OpenAI API responses sent, by HTTP status", ["code"], registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens routed", [WORKER], registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Tokens generated and relayed", [WORKER], registry=r
        )
        self.predicted_cached_tokens = Counter(
            p + "predicted_cached_tokens",
            "Prompt tokens the index predicted cached",
            [WORKER],
            registry=r,
        )
        self.cached_tokens = Counter(
            p + "cached_tokens", "Cached prompt tokens the worker reported", [WORKER], registry=r
        )
        self.retries = Counter(
            p + "retries",
            "Requests retried elsewhere after this worker failed",
            [WORKER],
            registry=r,
        )
        self.routing_seconds = Histogram(
            p + "routing_seconds",
            "Parse + tokenize + hash + lookup + score time",
            buckets=_ROUTING_BUCKETS,
            registry=r,
        )
        # Part of routing_seconds, apart because only kvroute pays it: routers that
        # route on text (sglang-router, vllm-router) never run the chat template or
        # tokenizer, and under load a long prompt's encode is most of the front.
        self.tokenize_seconds = Histogram(
            p + "tokenize_seconds",
            "Chat template + tokenization of a request's prompt",
            buckets=_ROUTING_BUCKETS,
            registry=r,
        )
        self.event_loop_lag_seconds = Histogram(
            p + "event_loop_lag_seconds",
            "How late the event loop woke from a 0.25 s sleep (gateway.observe.loop_lag)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.gc_pause_seconds = Histogram(
            p + "gc_pause_seconds",
            "How long each garbage collection held the process, by generation",
            ["generation"],
            buckets=GC_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            p + "ttft_seconds",
            "Time to first token seen by the gateway",
            [WORKER],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            p + "e2e_seconds",
            "Request time seen by the gateway",
            [WORKER],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight_requests = Gauge(
            p + "inflight_requests",
            "OpenAI API requests this gateway is handling now (the autoscaling metric)",
            registry=r,
        )
        self.index_blocks = Gauge(
            p + "index_blocks", "Blocks the index holds per worker", [WORKER], registry=r
        )
        self.index_event_lag = Gauge(
            p + "index_event_lag_seconds",
            "Now minus the timestamp of the last applied event batch",
            [WORKER],
            registry=r,
        )
        self.index_entries = Gauge(
            p + "index_entries", "(worker, block) entries in the index", registry=r
        )
        self.index_hashes = Gauge(
            p + "index_hashes", "Distinct block hashes in the index", registry=r
        )
        self.index_bytes = Gauge(p + "index_bytes", "Estimated memory of the index", registry=r)
        self.index_evictions = Gauge(
            p + "index_evicted_entries",
            "Entries dropped by --index-max-entries since start (monotonic)",
            registry=r,
        )
        self.healthy_workers = Gauge(
            p + "healthy_workers", "Workers the gateway routes to", registry=r
        )
        self.worker_gauges = {
            name: Gauge(p + "worker_" + name, text, [WORKER], registry=r)
            for name, text in WORKER_GAUGES
        }
        if vllm_model_name is not None:
            r.register(_VllmAliases(self, vllm_model_name))
        self._workers: dict[str, WorkerSeries] = {}

    def worker(self, worker_id: str) -> WorkerSeries:
        """``worker_id``'s children of the per-worker counters and histograms, made once:
        ``labels()`` costs about 1 us a call, and a request touches seven."""
        series = self._workers.get(worker_id)
        if series is None:
            series = self._workers[worker_id] = WorkerSeries(self, worker_id)
        return series

    def watch_tokenizer_caches(self, caches: Mapping[str, TokenizerCache | None]) -> None:
        """Exports the hit counters of the tokenizer's prefix caches (``None``: off)."""
        live = {name: cache for name, cache in caches.items() if cache is not None}
        if live:
            self.registry.register(_TokenizerCaches(live))

    def watch_http_pool(self, pool: HttpPool) -> None:
        """Exports the connection counts of the pool the openai-http upstream uses."""
        self.registry.register(_HttpPoolCollector(pool))

    def set_worker(self, worker_id: str, **values: float) -> None:
        """Sets the per-worker gauges named in ``WORKER_GAUGES`` (``running=3, ...``)."""
        for name, value in values.items():
            self.worker_gauges[name].labels(worker_id).set(value)

    def forget_worker(self, worker_id: str) -> None:
        """Removes a dead worker's gauges so dashboards stop showing stale values."""
        for gauge in (self.index_blocks, self.index_event_lag, *self.worker_gauges.values()):
            try:
                gauge.remove(worker_id)
            except KeyError:
                continue

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class WorkerSeries:
    """One worker's children of ``GatewayMetrics``' per-worker counters and histograms
    (never removed, unlike the gauges ``forget_worker`` drops, so they stay valid)."""

    __slots__ = (
        "_by_reason",
        "_metrics",
        "_worker_id",
        "cached_tokens",
        "e2e_seconds",
        "generation_tokens",
        "predicted_cached_tokens",
        "prompt_tokens",
        "ttft_seconds",
    )

    def __init__(self, metrics: GatewayMetrics, worker_id: str) -> None:
        self._metrics, self._worker_id = metrics, worker_id
        self._by_reason: dict[str, Any] = {}
        self.prompt_tokens = metrics.prompt_tokens.labels(worker_id)
        self.predicted_cached_tokens = metrics.predicted_cached_tokens.labels(worker_id)
        self.cached_tokens = metrics.cached_tokens.labels(worker_id)
        self.generation_tokens = metrics.generation_tokens.labels(worker_id)
        self.ttft_seconds = metrics.ttft_seconds.labels(worker_id)
        self.e2e_seconds = metrics.e2e_seconds.labels(worker_id)

    def requests(self, reason: str) -> Any:
        """The ``requests`` counter's child for this worker and ``reason``."""
        child = self._by_reason.get(reason)
        if child is None:
            child = self._by_reason[reason] = self._metrics.requests.labels(self._worker_id, reason)
        return child


class TokenizerCache(Protocol):
    """What the metrics read from a tokenizer prefix cache (``gateway.text``)."""

    hits: int
    misses: int
    reused_tokens: int

    def __len__(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...


class _TokenizerCaches(Collector):
    """The tokenizer's prefix caches, read at scrape time (the caches keep plain ints)."""

    def __init__(self, caches: Mapping[str, TokenizerCache]) -> None:
        self.caches = dict(caches)

    def describe(self) -> list[Metric]:
        return []  # computed at collect time

    def collect(self) -> Iterator[Metric]:
        p = "kvroute_gateway_tokenizer_cache_"
        lookups = CounterMetricFamily(
            p + "lookups",
            "Prompts looked up in a tokenizer prefix cache, by cache and result",
            labels=["cache", "result"],
        )
        reused = CounterMetricFamily(
            p + "reused_tokens",
            "Prompt token ids taken from a tokenizer prefix cache instead of tokenized",
            labels=["cache"],
        )
        entries = GaugeMetricFamily(
            p + "entries", "Text prefixes a tokenizer prefix cache holds", labels=["cache"]
        )
        tokens = GaugeMetricFamily(
            p + "tokens", "Token ids a tokenizer prefix cache holds", labels=["cache"]
        )
        for name, cache in self.caches.items():
            lookups.add_metric([name, "hit"], cache.hits)
            lookups.add_metric([name, "miss"], cache.misses)
            reused.add_metric([name], cache.reused_tokens)
            entries.add_metric([name], len(cache))
            tokens.add_metric([name], cache.cached_tokens)
        yield from (lookups, reused, entries, tokens)


class HttpPool(Protocol):
    """What the metrics read from the upstream's HTTP connection pool (``gateway.upstream``)."""

    opened: int
    reused: int
    resent: int

    def idle_connections(self) -> int: ...


class _HttpPoolCollector(Collector):
    """Connections to OpenAI-HTTP workers (vLLM): a keep-alive that breaks (a proxy that
    closes connections, a server's short keep-alive) shows as ``opened`` rising with
    the request rate instead of ``reused``."""

    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = "kvroute_gateway_upstream_http_"
        requests = CounterMetricFamily(
            p + "connections",
            "Connections to OpenAI-HTTP workers, by event: opened, reused (a request sent "
            "on a kept-alive one), resent (a request sent again: its kept-alive "
            "connection had been closed by the worker)",
            labels=["event"],
        )
        requests.add_metric(["opened"], self.pool.opened)
        requests.add_metric(["reused"], self.pool.reused)
        requests.add_metric(["resent"], self.pool.resent)
        idle = GaugeMetricFamily(
            p + "idle_connections", "Kept-alive connections to OpenAI-HTTP workers now idle"
        )
        idle.add_metric([], self.pool.idle_connections())
        yield from (requests, idle)


def _sum_samples(metric: Counter | Gauge | Histogram, suffix: str) -> dict[str, float]:
    """``{le or "": value}`` of one family's samples ending in ``suffix``, summed over workers."""
    out: dict[str, float] = defaultdict(float)
    for family in metric.collect():
        for s in family.samples:
            if s.name == family.name + suffix:
                out[s.labels.get("le", "")] += s.value
    return out


class _VllmAliases(Collector):
    """vLLM's names for the fleet-level figures, computed from the gateway's own series."""

    def __init__(self, metrics: GatewayMetrics, model_name: str) -> None:
        self.m = metrics
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # computed at collect time; nothing to check against the registry

    def collect(self) -> Iterator[Metric]:
        m, labels, value = self.m, ["model_name"], [self.model_name]
        counters = (
            ("vllm:prompt_tokens", m.prompt_tokens, "Prompt tokens routed."),
            ("vllm:generation_tokens", m.generation_tokens, "Generation tokens relayed."),
            ("vllm:prefix_cache_queries", m.prompt_tokens, "Prefix cache queries, in tokens."),
            ("vllm:prefix_cache_hits", m.cached_tokens, "Prefix cache hits, in tokens."),
        )
        for name, source, text in counters:
            family = CounterMetricFamily(name, text, labels=labels)
            family.add_metric(value, sum(_sum_samples(source, "_total").values()))
            yield family
        gauges = (
            ("vllm:num_requests_running", "running", "Requests running on the workers."),
            ("vllm:num_requests_waiting", "waiting", "Requests waiting on the workers."),
        )
        for name, key, text in gauges:
            gauge = GaugeMetricFamily(name, text, labels=labels)
            gauge.add_metric(value, sum(_sum_samples(m.worker_gauges[key], "").values()))
            yield gauge
        for name, hist, text in (
            ("vllm:time_to_first_token_seconds", m.ttft_seconds, "Time to first token."),
            ("vllm:e2e_request_latency_seconds", m.e2e_seconds, "End-to-end request latency."),
        ):
            buckets = _sum_samples(hist, "_bucket")
            histogram = HistogramMetricFamily(name, text, labels=labels)
            ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))
            if ordered:  # no worker has served a request yet: no buckets to show
                histogram.add_metric(
                    value, ordered, sum_value=sum(_sum_samples(hist, "_sum").values())
                )
            yield histogram
