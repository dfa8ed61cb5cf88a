"""``KVStoreHiCache``: an SGLang HiCache storage backend (``HiCacheStorage``) over a kvstore
cluster: the tier below SGLang's host (CPU) KV pool.

Load it with (docs/engine.md, "SGLang", has the whole command)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name":"kvstore","module_path":"engine_adapter.integrations.sglang_backend",
          "class_name":"KVStoreHiCache","interface_v1":1,
          "cluster":"/etc/kvstore/cluster.toml","tenant":"acme",
          "token_file":"/etc/kvstore/acme.token"}'

SGLang's keys are per-page chained SHA-256 hex strings of the tokens (and its own salt);
they carry no model, dtype or layout (sglang #33268), so every store key is namespaced by
the model, the host pool's dtype, layout and shape, the page size, and the TP/PP/CP rank
whose heads the page holds (MLA pages, which every TP rank holds whole, omit the TP rank:
rank 0 writes, every rank reads). The tenant salts every key too.

How a page is stored::

    interface_v1, layouts whose page is one run per K and V (page_first, page_first_direct,
    page_head; MLA: one run):   zero copy, one store block per run, straight between the
    host pool's memory and the store:
        page -> [K run] [V run]            keys: namespaced(key, part "0"), (key, part "1")
    otherwise (layer_first, page_unified, and the legacy get/set calls): one store block per
    page, the pool's flat page (get_data_page / set_from_flat_data_page), part "flat"

With ``"kv_format": "e4m3x16"`` (and a bf16, fp16 or fp32 pool) each run or flat page goes out
as per-16 FP8 and comes back through a staging buffer, dequantised into the pool
(engine_adapter/integrations/page_codec.py): 0.5625 of bf16's bytes, no longer zero copy.

``batch_exists`` counts leading pages whose every run is stored; ``batch_get_v1`` reports a
page True only when all of its runs landed. Store failures are misses (False, None, 0) and a
warning in the log: HiCache then computes the tokens. With ``--enable-storage-metrics``
(``storage_config.enable_storage_metrics``), ``get_stats()`` hands SGLang's metrics collector
the pages and GB/s of every read and write, which it exports as its own
``sglang:prefetch_pgs``, ``sglang:backup_pgs``, ``sglang:prefetch_bandwidth`` and
``sglang:backup_bandwidth`` histograms (SGLang counts storage hits itself from
``batch_exists``). Not supported (raises at start-up): ``tp_lcm_size`` head splitting and
the v2 calls of hybrid models (Mamba/SWA/DSA pools).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from client.sync_client import SyncKVClient
from engine_adapter.connector import StoreFailure
from engine_adapter.engine_keys import EngineKeyNamespace
from engine_adapter.integrations.adapter_config import AdapterConfig
from engine_adapter.integrations.page_codec import decode_runs, encode_runs, staging_for
from engine_adapter.kv_layout import E4M3X16_ENCODING
from kvstore.errors import QuorumError

log = logging.getLogger(__name__)

# Keys of --hicache-storage-backend-extra-config that SGLang itself reads.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
WHERE = "--hicache-storage-backend-extra-config"
FLAT_PART = "flat"
MAX_RUNS_PER_PAGE = 2  # zero copy for K and V runs; finer runs (layer_first) go flat
# The host pool's shape attributes that go into the namespace (MHA: heads; MLA: the latent).
SHAPE_ATTRIBUTES = ("layer_num", "head_num", "head_dim", "kv_lora_rank", "qk_rope_head_dim")


class KVStoreHiCache(HiCacheStorage):
    """SGLang HiCache storage over kvstore (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        # StorageBackendFactory("dynamic") calls backend_class(storage_config, kwargs) and then
        # register_mem_pool_host(host_pool): the namespace needs the pool, so it waits.
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.store_config = AdapterConfig.from_mapping(
            extra, where=WHERE, known_elsewhere=SGLANG_KEYS, strict=False
        )
        if storage_config.should_split_heads:
            raise ValueError(f"{WHERE}: tp_lcm_size head splitting is not supported by kvstore")
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.salt = self.store_config.tenant
        self.kv: SyncKVClient = self.store_config.connect()
        self.mem_pool_host: Any = None
        self.namespace: EngineKeyNamespace | None = None
        self.parts: tuple[str, ...] = (FLAT_PART,)
        self.quantized = False
        self.dtype = torch.bfloat16  # the host pool's, once registered
        self.metrics: StorageMetrics | None = (
            StorageMetrics() if storage_config.enable_storage_metrics else None
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool and fix the key namespace and the page format from it."""
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        num_runs = self._runs_per_page(host)
        zero_copy = self.interface_v1 and 0 < num_runs <= MAX_RUNS_PER_PAGE
        self.parts = tuple(str(i) for i in range(num_runs)) if zero_copy else (FLAT_PART,)
        config = self.config
        replicated = config.is_mla_model  # every TP rank holds the whole page
        shape = "x".join(
            f"{name}={getattr(host, name)}" for name in SHAPE_ATTRIBUTES if hasattr(host, name)
        )
        self.namespace = EngineKeyNamespace(
            engine="sglang",
            model=self.store_config.model_id or config.model_name or "unnamed-model",
            dtype=self.store_config.stored_kv_format(
                str(host.dtype).removeprefix("torch."), quantizes=True
            ),
            layout=f"sglang-{host.layout}-v1:{shape}:runs={len(self.parts)}",
            page_tokens=host.page_size,
            tp_rank=0 if replicated else config.tp_rank,
            tp_size=1 if replicated else config.tp_size,
            pp_rank=config.pp_rank,
            pp_size=config.pp_size,
            extra=(
                ("mla", str(int(replicated))),
                ("cp", f"{config.attn_cp_rank}/{config.attn_cp_size}"),
                ("dcp", f"{config.dcp_rank}/{config.dcp_size}"),  # MLA shards tokens by DCP
            ),
        )
        # e4m3x16: each run (or flat page) goes out quantised, lands in staging, then is
        # dequantised into the pool (engine_adapter/integrations/page_codec.py)
        self.quantized = self.namespace.dtype == E4M3X16_ENCODING
        self.dtype = host.dtype
        log.info(
            "kvstore HiCache namespace %s, %d store blocks per page",
            self.namespace.text,
            len(self.parts),
        )

    @staticmethod
    def _runs_per_page(host: Any) -> int:
        """Contiguous memory runs of one page in the host pool (0: no zero-copy meta)."""
        try:
            pointers, _ = host.get_page_buffer_meta(torch.arange(host.page_size))
        except (ValueError, NotImplementedError, AttributeError):
            return 0
        return len(pointers)

    # interface_v1: pages addressed by host-pool token slots (page i at host_indices[i * P]).
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if self.parts == (FLAT_PART,):
            return self._get_flat(keys, self._page_starts(host_indices, len(keys)))
        views = self._run_views(host_indices, len(keys))
        landed = self._get_into(self._store_keys(keys), views, len(keys))
        return self._per_page(landed)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not self.config.is_storage_writer:  # an MLA replica: rank 0 writes the page
            return [True] * len(keys)
        if self.parts == (FLAT_PART,):
            starts = self._page_starts(host_indices, len(keys))
            pages = [self.mem_pool_host.get_data_page(start, flat=True) for start in starts]
            return self._put(keys, [_byte_view(page) for page in pages])
        views = self._run_views(host_indices, len(keys))
        return self._put(keys, views)

    # The legacy calls: values and targets are flat pages (tensors).
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        self._check_registered()
        targets = list(target_locations or [None] * len(keys))
        targets = [
            self.mem_pool_host.get_dummy_flat_data_page() if t is None else t for t in targets
        ]
        landed = self._get_into(self._flat_keys(keys), [_byte_view(t) for t in targets], len(keys))
        return [target if ok else None for target, ok in zip(targets, landed, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        self._check_registered()
        if not self.config.is_storage_writer:
            return True
        return all(self._put(keys, [_byte_view(v) for v in values], parts=(FLAT_PART,)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages have every run stored (one batched lookup)."""
        store_keys = self._store_keys(keys)
        try:
            present = self.kv.contains(store_keys)
        except StoreFailure as exc:
            log.warning("kvstore lookup of %d pages failed: %s", len(keys), exc)
            return 0
        return next((i for i, ok in enumerate(self._per_page(present)) if not ok), len(keys))

    def close(self) -> None:
        self.kv.close()

    # Helpers.
    def _check_registered(self) -> EngineKeyNamespace:
        if self.namespace is None:
            raise ValueError(
                "KVStoreHiCache needs register_mem_pool_host(host_pool) before use: the key "
                "namespace includes the pool's dtype, layout and page size"
            )
        return self.namespace

    def _store_keys(self, keys: Sequence[str], parts: Sequence[str] | None = None) -> list[bytes]:
        """Store keys, page by page, its runs in order: [p0 run0, p0 run1, p1 run0, ...]."""
        namespace = self._check_registered()
        parts = self.parts if parts is None else parts
        per_part = [namespace.keys(keys, self.salt, part) for part in parts]
        return [per_part[j][i] for i in range(len(keys)) for j in range(len(parts))]

    def _flat_keys(self, keys: Sequence[str]) -> list[bytes]:
        return self._store_keys(keys, (FLAT_PART,))

    def _per_page(self, flags: list[bool]) -> list[bool]:
        n = len(self.parts)
        return [all(flags[i : i + n]) for i in range(0, len(flags), n)]

    def _page_starts(self, host_indices: torch.Tensor, num_pages: int) -> list[int]:
        page_size = self.mem_pool_host.page_size
        if len(host_indices) != num_pages * page_size:
            raise ValueError(
                f"{num_pages} keys need {num_pages * page_size} host indices (page size "
                f"{page_size}), got {len(host_indices)}"
            )
        return host_indices[::page_size].tolist()

    def _run_views(self, host_indices: torch.Tensor, num_pages: int) -> list[memoryview]:
        """Writable views of the pages' runs in the host pool's own memory (zero copy)."""
        self._page_starts(host_indices, num_pages)
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        regions = _pool_regions(self.mem_pool_host)
        return [_memory_at(p, n, regions) for p, n in zip(pointers, sizes, strict=True)]

    def _get_into(
        self, store_keys: list[bytes], views: list[memoryview], num_pages: int
    ) -> list[bool]:
        started = time.perf_counter()
        targets = staging_for(views, self.dtype) if self.quantized else views
        try:
            landed = self.kv.get_batch_into(store_keys, targets)
        except StoreFailure as exc:  # a page the store cannot deliver is computed instead
            log.warning("kvstore read of %d blocks failed: %s", len(store_keys), exc)
            return [False] * len(store_keys)
        if self.quantized:
            landed = decode_runs(targets, views, self.dtype, landed)
        if self.metrics is not None:
            num_bytes = sum(len(v) for v, ok in zip(views, landed, strict=True) if ok)
            self.metrics.prefetch_pgs.append(num_pages)
            self.metrics.prefetch_bandwidth.append(_gb_per_s(num_bytes, started))
        return landed

    def get_stats(self) -> StorageMetrics | None:
        """The reads' and writes' pages and GB/s since the last call (SGLang's storage
        metrics collector exports them); None without --enable-storage-metrics."""
        if self.metrics is None:
            return None
        stats, self.metrics = self.metrics, StorageMetrics()
        return stats

    def _get_flat(self, keys: list[str], starts: list[int]) -> list[bool]:
        pages = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        landed = self._get_into(self._flat_keys(keys), [_byte_view(p) for p in pages], len(keys))
        for start, page, ok in zip(starts, pages, landed, strict=True):
            if ok:
                self.mem_pool_host.set_from_flat_data_page(start, page)
        return landed

    def _put(
        self, keys: list[str], views: list[memoryview], parts: Sequence[str] | None = None
    ) -> list[bool]:
        """put_batch the views (runs or flat pages, in _store_keys order); True per page stored."""
        store_keys = self._store_keys(keys, parts)
        started = time.perf_counter()
        if self.quantized:
            views = encode_runs(views, self.dtype)
        try:
            self.kv.put_batch(store_keys, views, traffic_class=self.store_config.traffic_class)
            stored = [True] * len(store_keys)
        except QuorumError as exc:
            failed = set(exc.keys)
            stored = [key not in failed for key in store_keys]
            log.warning(
                "kvstore stored %d of %d blocks: %s",
                len(store_keys) - len(failed),
                len(store_keys),
                exc,
            )
        except StoreFailure as exc:
            log.warning("kvstore write of %d blocks failed: %s", len(store_keys), exc)
            stored = [False] * len(store_keys)
        if self.metrics is not None:
            num_bytes = sum(len(v) for v, ok in zip(views, stored, strict=True) if ok)
            self.metrics.backup_pgs.append(len(keys))
            self.metrics.backup_bandwidth.append(_gb_per_s(num_bytes, started))
        n = len(store_keys) // len(keys) if keys else 1
        return [all(stored[i : i + n]) for i in range(0, len(stored), n)]


def _gb_per_s(num_bytes: int, started: float) -> float:
    return num_bytes / max(time.perf_counter() - started, 1e-9) / 1e9


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a writable memoryview (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"expected a contiguous CPU page, got {tensor.device} {tuple(tensor.shape)}"
        )
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def _pool_regions(host: Any) -> list[tuple[int, int]]:
    """(start, end) addresses of the host pool's buffers: zero-copy views must fall inside."""
    regions = []
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        buffer = getattr(host, name, None)
        if isinstance(buffer, torch.Tensor):
            start = buffer.data_ptr()
            regions.append((start, start + buffer.numel() * buffer.element_size()))
    return regions


def _memory_at(address: int, num_bytes: int, regions: list[tuple[int, int]]) -> memoryview:
    if not any(start <= address and address + num_bytes <= end for start, end in regions):
        raise ValueError(
            f"the host pool gave a page run at {address:#x} (+{num_bytes}) outside its buffers"
        )
    return memoryview((ctypes.c_char * num_bytes).from_address(address)).cast("B")
