"""Prometheus metrics of the router and the workers, named after vLLM's where the meaning is
the same (``vllm:*``) and ``kvstore:*`` where vLLM has no such metric.

Each component registers into its own ``CollectorRegistry`` (several routers or workers may
live in one test process). The router's metrics are served at ``GET /metrics`` of the HTTP
front; each worker serves its own on ``--metrics-port`` (its address is in its Health reply).

Every series carries ``model_name`` (the served model's name), as vLLM's do, so vLLM's stock
dashboards match ours; counters emit no ``_created`` series (``disable_created_metrics``: a
scrape then has one series per counter, as vLLM's dashboards and alert rules expect). The
whole list, with the meaning of each, is in ``engine_adapter/README.md`` ("Metrics").
Router and worker gauges differ in scope: the router's ``running`` requests are decoding
(past their first token) and its ``waiting`` ones have no first token yet; a worker's
``running`` request holds its engine and its ``waiting`` ones queue for it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

disable_created_metrics()  # process-wide: no ``*_created`` series from any counter here

# vLLM's bucket edges, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SOURCE_COMPUTED, SOURCE_STORE = "local_compute", "external_kv_transfer"
MODEL_LABEL = "model_name"


class ModelLabelled:
    """A metric with more labels than ``model_name``, that label filled in:
    ``metric.labels(source)`` is the series ``{model_name=..., source=...}``."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self._metric, self._model_name = metric, model_name

    def labels(self, *values: str) -> Any:
        return self._metric.labels(self._model_name, *values)


class _Factory:
    """Makes metrics of one registry, each labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name

    def __call__(self, kind: type, name: str, doc: str, labels: tuple[str, ...] = (),
                 **kwargs: Any) -> Any:  # fmt: skip
        """The metric's one series (no other labels), or a :class:`ModelLabelled`."""
        metric = kind(name, doc, [MODEL_LABEL, *labels], registry=self.registry, **kwargs)
        if labels:
            return ModelLabelled(metric, self.model_name)
        return metric.labels(self.model_name)


class PromptMetrics:
    """What the router and prefill workers both count about prompts and store fetches."""

    def __init__(self, registry: CollectorRegistry | None, model_name: str) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        metric = self._metric = _Factory(self.registry, model_name)
        self.running = metric(Gauge, "vllm:num_requests_running", "Requests running.")
        self.waiting = metric(Gauge, "vllm:num_requests_waiting", "Requests waiting.")
        self.prompt_tokens = metric(
            Counter, "vllm:prompt_tokens", "Prompt tokens of finished prefills."
        )
        self.prompt_tokens_by_source = metric(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by source: computed here or swapped in from the store.",
            ("source",),
        )
        for source in (SOURCE_COMPUTED, SOURCE_STORE):  # both series exist from the start
            self.prompt_tokens_by_source.labels(source)
        self.generation_tokens = metric(Counter, "vllm:generation_tokens", "Generated tokens.")
        self.fetch_bytes = metric(
            Counter, "kvstore:store_fetch_bytes", "KV bytes swapped in from the store."
        )
        self.fetch_fallbacks = metric(
            Counter,
            "kvstore:store_fetch_fallbacks",
            "Prefills that computed tokens the store held, by reason.",
            ("reason",),
        )

    def prefilled(
        self, num_computed: int, num_cached: int, fetch_bytes: int, fallback: str
    ) -> None:
        self.prompt_tokens.inc(num_computed + num_cached)
        self.prompt_tokens_by_source.labels(SOURCE_COMPUTED).inc(num_computed)
        self.prompt_tokens_by_source.labels(SOURCE_STORE).inc(num_cached)
        self.fetch_bytes.inc(fetch_bytes)
        if fallback:
            self.fetch_fallbacks.labels(fallback).inc()


class RouterMetrics(PromptMetrics):
    """The router's metrics (served at the HTTP front's ``/metrics``)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        super().__init__(registry, model_name)
        metric = self._metric
        self.ttft = metric(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=TTFT_BUCKETS_S,
        )
        self.itl = metric(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Time between two tokens of a request.",
            buckets=ITL_BUCKETS_S,
        )
        self.e2e = metric(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=E2E_BUCKETS_S,
        )
        self.success = metric(
            Counter, "vllm:request_success", "Finished requests.", ("finished_reason",)
        )
        self.prefill_requests = metric(
            Counter,
            "kvstore:prefill_requests",
            "Prefill requests routed, by prompt length bucket and worker.",
            ("bucket", "worker"),
        )
        self.errors = metric(
            Counter, "kvstore:request_errors", "Failed requests, by HTTP status.", ("code",)
        )
        self.migrations = metric(
            Counter, "kvstore:decode_migrations", "Requests moved off a draining decode worker."
        )
        self.closed_connections = metric(
            Counter,
            "kvstore:http_connections_closed",
            "HTTP connections the front closed: header_timeout, body_timeout, "
            "body_too_large or connection_limit.",
            ("reason",),
        )


class WorkerMetrics(PromptMetrics):
    """A worker's metrics (served on its ``--metrics-port``)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        super().__init__(registry, model_name)
        metric = self._metric
        self.prefill_time = metric(
            Histogram,
            "vllm:request_prefill_time_seconds",
            "Engine time of one prefill: lookup, fetch and compute.",
            buckets=TTFT_BUCKETS_S,
        )
        self.migrations = metric(
            Counter,
            "kvstore:decode_migrations",
            "Requests this decode worker handed on while draining.",
        )
        self.recomputed_tokens = metric(
            Counter,
            "kvstore:decode_recomputed_tokens",
            "Prompt tokens computed because the store could not return their blocks.",
        )
