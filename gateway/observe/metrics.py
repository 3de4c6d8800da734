"""The gateway's Prometheus metrics, on a registry of its own (names per docs/INTERFACES.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_ROUTING_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOAD_KINDS = ("running", "waiting", "queued_prefill_tokens", "free_blocks", "inflight")


class GatewayMetrics:
    """Every ``kvroute_gateway_*`` series; one instance per app."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "kvroute_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests routed, by worker and reason",
            ["worker", "reason"],
            registry=r,
        )
        self.responses = Counter(
            p + "responses", "Responses sent, by HTTP status", ["code"], registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens routed", ["worker"], registry=r
        )
        self.predicted_cached_tokens = Counter(
            p + "predicted_cached_tokens",
            "Prompt tokens the index predicted cached",
            ["worker"],
            registry=r,
        )
        self.cached_tokens = Counter(
            p + "cached_tokens", "Cached prompt tokens the worker reported", ["worker"], registry=r
        )
        self.retries = Counter(
            p + "retries",
            "Requests retried elsewhere after this worker failed",
            ["worker"],
            registry=r,
        )
        self.routing_seconds = Histogram(
            p + "routing_seconds",
            "Parse + tokenize + hash + lookup + score time",
            buckets=_ROUTING_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            p + "ttft_seconds",
            "Time to first token seen by the gateway",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            p + "e2e_seconds",
            "Request time seen by the gateway",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.index_blocks = Gauge(
            p + "index_blocks", "Blocks the index holds per worker", ["worker"], registry=r
        )
        self.index_event_lag = Gauge(
            p + "index_event_lag_seconds",
            "Now minus the timestamp of the last applied event batch",
            ["worker"],
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
        self.worker_load = Gauge(
            p + "worker_load", "Worker load as the router sees it", ["worker", "kind"], registry=r
        )

    def forget_worker(self, worker_id: str) -> None:
        """Removes a dead worker's gauges so dashboards stop showing stale values."""
        for gauge in (self.index_blocks, self.index_event_lag):
            try:
                gauge.remove(worker_id)
            except KeyError:
                continue
        for kind in LOAD_KINDS:
            try:
                self.worker_load.remove(worker_id, kind)
            except KeyError:
                continue

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
