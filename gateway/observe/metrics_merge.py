"""One ``/metrics`` for a gateway of several processes: their expositions merged.

Every process counts what it served, so counters, histograms and summaries add
up. Gauges mostly describe the fleet as every process sees it (healthy
workers, per-worker queues from the shared heartbeats, the index, which only
the owner holds): those are the first text's, the owner's. The gauges in
``PER_PROCESS`` measure each process's own share (its requests in flight, its
memory, its tokenizer caches) and add up too.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PER_PROCESS = frozenset(
    {
        "kvroute_gateway_inflight_requests",
        "kvroute_gateway_tokenizer_cache_entries",
        "kvroute_gateway_tokenizer_cache_tokens",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    }
)
_ADDED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_metrics(texts: list[bytes]) -> bytes:
    """The text exposition of ``texts`` (the owner's first) as one process's."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for i, text in enumerate(texts):
        for family in text_string_to_metric_families(text.decode()):
            adds = family.type in _ADDED_TYPES or family.name in PER_PROCESS
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            elif not adds and i > 0:
                continue  # the owner's (or the first seen) view of a fleet gauge
            merged = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if s.name.endswith("_created"):  # when the series began: the earliest
                    merged[key] = min(merged.get(key, s.value), s.value)
                else:
                    merged[key] = merged.get(key, 0.0) + s.value if adds else s.value
    for name, family in families.items():
        for (sample, labels), value in values[name].items():
            family.add_sample(sample, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)
