"""Prometheus metrics of one node, on a registry of its own (several nodes may share a process).

Request counts and latencies are observed by the server as RPCs finish. Store figures (shards,
bytes, hits, misses, corrupt shards and the per-class TTL figures) are read from the store at
scrape time, so they equal the persisted counters that ``Stats`` reports and survive restarts.
Names follow Prometheus' conventions: units in the name, ``_total`` on counters, timestamps as
``_timestamp_seconds`` in real (Unix) time even when the cluster runs on a scaled clock, and a
series that has no value yet is absent (never a -1)::

    kvstore_requests_total{rpc,code}         kvstore_request_seconds{rpc}   (histogram)
    kvstore_put_shards_total                 kvstore_get_keys_total
    kvstore_put_bytes_total  kvstore_read_bytes_total                (shard bytes in and out;
                                  out: in read answers, not what a same-host client's landing
                                  pool got placed straight into it)
    kvstore_tenant_reads_total{tenant,outcome}   shard reads per tenant, outcome hit or miss
                                                 (a peer's repair reads are not counted); only
                                                 known tenants by name (the credentials file's
                                                 with auth, else the first 64 seen), the rest
                                                 as tenant="_other"
    kvstore_shards  kvstore_shard_bytes  kvstore_used_bytes  kvstore_capacity_bytes
    kvstore_segments  kvstore_hits_total  kvstore_misses_total  kvstore_corrupt_shards_total
    kvstore_class_shards{traffic_class}  kvstore_class_shard_bytes{traffic_class}
    kvstore_class_{hits,misses,expired,evicted}_total{traffic_class}
    kvstore_class_youngest_evicted_age_seconds{traffic_class}      (+Inf until one is evicted)
    kvstore_scrubbed_bytes_total  kvstore_scrub_passes_total        (since the node started)
    kvstore_scrub_last_full_pass_timestamp_seconds                  (once a pass finished)
    kvstore_index_bytes  kvstore_quarantined_bytes  kvstore_retired_versions_total
    kvstore_evicted_blocks_total  kvstore_peer_removed_shards_total  kvstore_compacted_bytes_total
    kvstore_dead_bytes
    kvstore_repair_{backlog_shards,waiting_shards,at_risk_blocks,backlog_bytes,eta_s}
    kvstore_repair_{pending_groups,unrecoverable,queued_hints}      (the repair service,
    kvstore_repair_{rebuilt_shards,rebuilt_bytes,read_bytes}_total   kvstore/node/repair_service.py:
    kvstore_repair_{skipped_expiring,fenced,passes}_total             now, and since the start)
    kvstore_build_info{version,python}  process_*  python_info     (standard collectors)

No ``_created`` series: counters and histograms export only their values, as Prometheus'
own exporters do (prometheus_client's are turned off here, and for every process the
``kvstore`` command starts, by kvstore/cli/commands.py).

HTTP: ``/metrics`` serves the metrics and ``/healthz`` answers 200 "ok" while the node serves
(503 otherwise); any other path is 404. With ``NodeConfig.metrics_auth`` /metrics needs an
``Authorization: Bearer <token>`` header of an admin or node principal (401 otherwise);
/healthz stays open.
"""

from __future__ import annotations

import math
import platform
import socketserver
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from importlib import metadata
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.node.repair_service import RepairStats
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.shard_store import StoreStats

disable_created_metrics()  # see the module docstring
# Loopback RPCs take ~100 us; 4 MiB batches and fsyncs take ms; stragglers take seconds.
MAX_TENANT_LABELS = 64  # tenants named in kvstore_tenant_reads_total; the rest are "_other"
OTHER_TENANT = "_other"  # not a valid tenant name (request_checks.TENANT_CHARS), so no clash
LATENCY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
_NODE_GAUGES = {
    "shards": ("num_shards", "shards held"),
    "shard_bytes": ("shard_bytes", "bytes of live shards"),
    "used_bytes": ("used_bytes", "disk bytes of segment data: live records, dead ones not punched"),
    "capacity_bytes": ("capacity_bytes", "effective byte limit (configured or disk)"),
    "segments": ("num_segments", "segment files"),
    "index_bytes": ("index_bytes", "disk bytes of the index files (inside the byte limit)"),
    "quarantined_bytes": ("quarantined_bytes", "segment bytes moved to quarantine/"),
    "dead_bytes": ("dead_bytes", "segment bytes of records no entry uses (compaction frees them)"),
}
_NODE_COUNTERS = {
    "hits": ("hits", "keys served"),
    "misses": ("misses", "keys not found, including keys of no known class"),
    "corrupt_shards": ("corrupt_shards", "shards that failed a checksum (never served)"),
    "scrubbed_bytes": ("scrubbed_bytes", "record bytes re-read and verified by the scrub"),
    "scrub_passes": ("num_scrub_passes", "full scrub passes finished"),
    "retired_versions": ("retired_versions", "older versions dropped by newer writes"),
    "evicted_blocks": ("evicted_blocks", "blocks evicted for the whole group (delete log)"),
    "peer_removed_shards": ("peer_removed_shards", "shards removed by peers' delete logs"),
    "compacted_bytes": ("compacted_bytes", "dead segment bytes freed by background compaction"),
}
_REPAIR_GAUGES = {
    "backlog_shards": "shards the led groups' readable blocks lack, as last listed",
    "waiting_shards": "of the backlog, shards whose member is down or not ready",
    "at_risk_blocks": "blocks of the led groups with fewer than k+m shards",
    "backlog_bytes": "bytes a rebuild of the backlog moves (read and written)",
    "eta_s": "seconds the backlog's rebuild takes at the repair rate",
    "pending_groups": "led groups whose listing is due",
    "unrecoverable": "blocks of the led groups with fewer than k shards (last pass)",
    "queued_hints": "read-repair and degraded-write hints waiting",
}
_REPAIR_COUNTERS = {
    "rebuilt_shards": "shards rebuilt and stored on their nodes",
    "rebuilt_bytes": "bytes of the shards rebuilt",
    "read_bytes": "survivor shard bytes read to rebuild",
    "skipped_expiring": "blocks not rebuilt: they expire before the rebuild would finish",
    "fenced": "rebuilt shards refused: the key was deleted after the repair read it",
    "passes": "listing passes over a led group",
}
# Metric suffix -> ClassStats field (the store counts shards per class in ``blocks``).
_CLASS_GAUGES = {"shards": "blocks", "shard_bytes": "bytes"}
_CLASS_COUNTERS = ("hits", "misses", "expired", "evicted")


def _version() -> str:
    try:
        return metadata.version("kvstore")
    except metadata.PackageNotFoundError:
        return "unknown"


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats], repair: Callable[[], RepairStats]) -> None:
        self._stats = stats
        self._repair = repair

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, (attr, doc) in _NODE_GAUGES.items():
            yield GaugeMetricFamily(f"kvstore_{name}", doc, value=getattr(stats, attr))
        for name, (attr, doc) in _NODE_COUNTERS.items():
            yield CounterMetricFamily(f"kvstore_{name}", doc, value=getattr(stats, attr))
        if stats.last_full_pass_unix_s is not None:
            yield GaugeMetricFamily(
                "kvstore_scrub_last_full_pass_timestamp_seconds",
                "Unix time the last full scrub pass ended",
                value=stats.last_full_pass_unix_s,
            )
        yield from _class_metrics(stats)
        repair = self._repair()
        for name, doc in _REPAIR_GAUGES.items():
            yield GaugeMetricFamily(f"kvstore_repair_{name}", doc, value=getattr(repair, name))
        for name, doc in _REPAIR_COUNTERS.items():
            yield CounterMetricFamily(f"kvstore_repair_{name}", doc, value=getattr(repair, name))


def _class_metrics(stats: StoreStats) -> Iterator[Metric]:
    labels = ["traffic_class"]
    for suffix, attr in _CLASS_GAUGES.items():
        doc = f"{suffix.replace('_', ' ')} per traffic class"
        family = GaugeMetricFamily(f"kvstore_class_{suffix}", doc, labels=labels)
        for cls in stats.classes:
            family.add_metric([cls.traffic_class], getattr(cls, attr))
        yield family
    for figure in _CLASS_COUNTERS:
        family = CounterMetricFamily(
            f"kvstore_class_{figure}", f"{figure} per traffic class", labels=labels
        )
        for cls in stats.classes:
            family.add_metric([cls.traffic_class], getattr(cls, figure))
        yield family
    youngest = GaugeMetricFamily(
        "kvstore_class_youngest_evicted_age_seconds",
        "smallest time since last access among capacity-evicted entries",
        labels=labels,
    )
    for cls in stats.classes:
        # The youngest age of nothing evicted is +Inf (the minimum of no ages), not 0, which
        # would read as "evicts blocks just used" on the dashboard's min().
        age_s = cls.youngest_evicted_age_s
        youngest.add_metric([cls.traffic_class], math.inf if age_s is None else age_s)
    yield youngest


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds up the node's shutdown


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # scrapes are not log lines
        pass


class NodeMetrics:
    """The metrics of one node; ``serve(host, port, is_serving)`` exposes them over HTTP."""

    def __init__(
        self,
        stats: Callable[[], StoreStats],
        repair: Callable[[], RepairStats] = RepairStats,
        known_tenants: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``known_tenants``: the tenants the credentials file names (auth on), the only
        ones labelled by name; None (auth off): the first ``MAX_TENANT_LABELS`` seen."""
        self._known_tenants = known_tenants
        self._labelled_tenants: set[str] = set()
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
        self.put_bytes = Counter(
            "kvstore_put_bytes", "shard bytes of the puts received", registry=self.registry
        )
        self.read_bytes = Counter(
            "kvstore_read_bytes", "shard bytes served to reads", registry=self.registry
        )
        self.tenant_reads = Counter(
            "kvstore_tenant_reads",
            "shard reads per tenant: hit (served) or miss (not held, expired or corrupt)",
            ["tenant", "outcome"],
            registry=self.registry,
        )
        self._start_series_at_zero()
        self.registry.register(_StoreCollector(stats, repair))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        Info("kvstore_build", "kvstore version", registry=self.registry).info(
            {"version": _version(), "python": platform.python_version()}
        )
        self._http: WSGIServer | None = None

    def _start_series_at_zero(self) -> None:
        """Every series a dashboard or alert reads exists on a fresh node, at zero: each RPC's
        OK count and latency, and the reads of tenants not labelled by name."""
        for rpc in pb.DESCRIPTOR.services_by_name["ShardStore"].methods_by_name:
            self.requests.labels(rpc, grpc.StatusCode.OK.name)
            self.latency.labels(rpc)
        for outcome in ("hit", "miss"):
            self.tenant_reads.labels(OTHER_TENANT, outcome)

    def observe(self, rpc: str, code: grpc.StatusCode, elapsed_s: float) -> None:
        self.requests.labels(rpc, code.name).inc()
        self.latency.labels(rpc).observe(elapsed_s)

    def observe_reads(self, tenant: str, num_keys: int, num_hits: int, num_bytes: int) -> None:
        """One read of ``num_keys`` keys for ``tenant``: how many it served, and their bytes."""
        label = self._tenant_label(tenant)
        self.tenant_reads.labels(label, "hit").inc(num_hits)
        self.tenant_reads.labels(label, "miss").inc(max(num_keys - num_hits, 0))
        self.read_bytes.inc(num_bytes)

    def _tenant_label(self, tenant: str) -> str:
        """``tenant`` if it may be a label, else OTHER_TENANT: made-up names in requests must
        neither grow /metrics without bound nor appear in it."""
        if tenant in self._labelled_tenants:
            return tenant
        known = self._known_tenants is None or tenant in self._known_tenants()
        if not known or len(self._labelled_tenants) >= MAX_TENANT_LABELS:
            return OTHER_TENANT
        self._labelled_tenants.add(tenant)
        return tenant

    def serve(
        self,
        host: str,
        port: int,
        is_serving: Callable[[], bool] = lambda: True,
        authorize: Callable[[str], bool] | None = None,
    ) -> None:
        """Serve ``/metrics`` and ``/healthz`` on ``host:port`` in a background thread.

        ``authorize`` (given the Authorization header) guards /metrics when set.
        """
        app = _routes(make_wsgi_app(self.registry), is_serving, authorize)
        self._http = make_server(host, port, app, _Server, handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="metrics").start()

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _routes(
    metrics_app: Callable,
    is_serving: Callable[[], bool],
    authorize: Callable[[str], bool] | None = None,
) -> Callable:
    """A WSGI app: /metrics -> ``metrics_app`` (if authorized), /healthz -> 200 or 503,
    else 404."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            if authorize is not None and not authorize(environ.get("HTTP_AUTHORIZATION", "")):
                start_response("401 Unauthorized", [("Content-Type", "text/plain")])
                return [b"send Authorization: Bearer <admin or node token>\n"]
            return metrics_app(environ, start_response)
        if path == "/healthz":
            ok = is_serving()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not serving\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    return app
