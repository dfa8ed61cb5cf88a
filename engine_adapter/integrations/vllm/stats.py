"""The connector's counters: vLLM logs them as "KV Transfer metrics" and exports them as
``vllm:kvstore_*`` Prometheus counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

STAT_COUNTERS = (
    "num_lookups",  # scheduler: lookups asked of the store
    "hit_blocks",  # scheduler: blocks the store held (for every slice), offered to vLLM
    "miss_blocks",  # scheduler: blocks looked up past the hit run
    "num_loads",  # worker: start_load_kv calls that loaded blocks
    "loaded_blocks",
    "loaded_bytes",
    "load_failed_blocks",  # planned, did not land: vLLM recomputes them
    "saved_blocks",
    "saved_bytes",
    "save_failed_blocks",
    "save_skipped_blocks",  # every save slot was in flight
)
STAT_SECONDS = ("load_s",)  # worker: seconds from start_load_kv to the last byte placed


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """The connector's counters for one interval (vLLM sums workers' and the scheduler's
    with ``aggregate``, logs ``reduce()`` as "KV Transfer metrics" and feeds Prometheus)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_COUNTERS, 0) | dict.fromkeys(STAT_SECONDS, 0.0)

    def add(self, **values: float) -> None:
        for name, value in values.items():
            self.data[name] += value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        looked_up = self.data["hit_blocks"] + self.data["miss_blocks"]
        load_s = self.data["load_s"]
        return {
            **self.data,
            "hit_rate": round(self.data["hit_blocks"] / looked_up, 4) if looked_up else 0.0,
            "load_gb_per_s": round(self.data["loaded_bytes"] / load_s / 1e9, 3) if load_s else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstore_<counter>_total`` per engine, from each interval's stats."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[tuple[int, str], Any] = {}
        for name in (*STAT_COUNTERS, *STAT_SECONDS):
            counter = self._counter_cls(
                name=f"vllm:kvstore_{name}",
                documentation=f"kvstore connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            for engine_idx, labelvalues in per_engine_labelvalues.items():
                self.counters[(engine_idx, name)] = counter.labels(*labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self.counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)
