"""Prometheus metrics of one node, on a registry of its own (several nodes may share a process).

Request counts and latencies are observed by the server as RPCs finish. Store figures (shards,
bytes, hits, misses, corrupt shards and the per-class TTL figures) are read from the store at
scrape time, so they equal the persisted counters that ``Stats`` reports and survive restarts::

    kvstore_requests_total{rpc,code}         kvstore_request_seconds{rpc}   (histogram)
    kvstore_put_shards_total                 kvstore_get_keys_total
    kvstore_shards  kvstore_bytes  kvstore_used_bytes  kvstore_capacity_bytes  kvstore_segments
    kvstore_hits_total  kvstore_misses_total  kvstore_corrupt_shards_total
    kvstore_class_{blocks,bytes}{traffic_class}
    kvstore_class_{hits,misses,expired,evicted}_total{traffic_class}
    kvstore_class_youngest_evicted_age_seconds{traffic_class}   (-1 = nothing evicted yet)
    kvstore_scrubbed_bytes_total  kvstore_scrub_passes_total        (since the node started)
    kvstore_scrub_last_full_pass_seconds    (store-clock time; -1 = no full pass yet)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.shard_store import StoreStats

# Loopback RPCs take ~100 us; 4 MiB batches and fsyncs take ms; stragglers take seconds.
LATENCY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
_NODE_GAUGES = {
    "shards": ("num_shards", "shards held"),
    "bytes": ("shard_bytes", "bytes of live shards"),
    "used_bytes": ("used_bytes", "bytes of segment files, live and dead records"),
    "capacity_bytes": ("capacity_bytes", "effective byte limit (configured or disk)"),
    "segments": ("num_segments", "segment files"),
    "scrub_last_full_pass_seconds": (
        "last_full_pass_s",
        "store-clock time the last full scrub pass ended (-1 = none yet)",
    ),
}
_NODE_COUNTERS = {
    "hits": ("hits", "keys served"),
    "misses": ("misses", "keys not found, including keys of no known class"),
    "corrupt_shards": ("corrupt_shards", "shards that failed a checksum (never served)"),
    "scrubbed_bytes": ("scrubbed_bytes", "record bytes re-read and verified by the scrub"),
    "scrub_passes": ("num_scrub_passes", "full scrub passes finished"),
}
_CLASS_GAUGES = ("blocks", "bytes")
_CLASS_COUNTERS = ("hits", "misses", "expired", "evicted")


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, (attr, doc) in _NODE_GAUGES.items():
            yield GaugeMetricFamily(f"kvstore_{name}", doc, value=getattr(stats, attr))
        for name, (attr, doc) in _NODE_COUNTERS.items():
            yield CounterMetricFamily(f"kvstore_{name}", doc, value=getattr(stats, attr))
        yield from _class_metrics(stats)


def _class_metrics(stats: StoreStats) -> Iterator[Metric]:
    labels = ["traffic_class"]
    for figure in _CLASS_GAUGES:
        family = GaugeMetricFamily(f"kvstore_class_{figure}", f"{figure} per class", labels=labels)
        for cls in stats.classes:
            family.add_metric([cls.traffic_class], getattr(cls, figure))
        yield family
    for figure in _CLASS_COUNTERS:
        family = CounterMetricFamily(
            f"kvstore_class_{figure}", f"{figure} per class", labels=labels
        )
        for cls in stats.classes:
            family.add_metric([cls.traffic_class], getattr(cls, figure))
        yield family
    youngest = GaugeMetricFamily(
        "kvstore_class_youngest_evicted_age_seconds",
        "smallest time since last access among capacity-evicted entries (-1 = none)",
        labels=labels,
    )
    for cls in stats.classes:
        youngest.add_metric([cls.traffic_class], cls.youngest_evicted_age_s)
    yield youngest


class NodeMetrics:
    """The metrics of one node; ``serve(port)`` exposes them over HTTP."""

    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstore_requests", "RPCs by method and status", ["rpc", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "kvstore_request_seconds",
            "RPC latency, including any injected delay",
            ["rpc"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.put_shards = Counter("kvstore_put_shards", "new shards stored", registry=self.registry)
        self.get_keys = Counter("kvstore_get_keys", "keys asked for", registry=self.registry)
        self.registry.register(_StoreCollector(stats))
        self._http: WSGIServer | None = None

    def observe(self, rpc: str, code: grpc.StatusCode, elapsed_s: float) -> None:
        self.requests.labels(rpc, code.name).inc()
        self.latency.labels(rpc).observe(elapsed_s)

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` in a background thread."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
