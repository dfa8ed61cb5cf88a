"""``KVStoreConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over a kvstore cluster.

Load it with (docs/engine.md, "vLLM", has the whole command)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVStoreConnector",
        "kv_role":"kv_both","kv_connector_module_path":"engine_adapter.integrations.vllm_connector",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"cluster":"/etc/kvstore/cluster.toml","tenant":"acme",
            "token_file":"/etc/kvstore/acme.token"}}'

``kv_load_failure_policy: "recompute"`` matters: vLLM's default ("fail") fails a request
whose blocks did not load; with "recompute" a block the store could not deliver (a node
outage after the lookup, an expired block) is computed instead.

One store block is one vLLM block (``block_size`` tokens) of every layer this worker holds,
keyed by the request's ``block_hashes[i]`` (which vLLM chains from the prompt and the
request's ``cache_salt``; the tenant and the salt also go into the key's salt) under a
namespace of the model, KV dtype, layout with its shape, block size and the slice of the KV
this worker holds (engine_adapter/engine_keys.py)::

    store block = [layer 0 | layer 1 | ... | layer L-1]      layers in kv_cache_groups order
    layer       = vLLM's logical [H, N, C] page of the block   H heads, N = block_size tokens,
                                                              C = K and V of a head (MLA: H = 1,
                                                              C = the latent), C order

Tensor parallelism: a TP rank holds KV heads ``[a, b)`` of the model's ``n``; its blocks go
under a namespace that names that slice (``tp=<shard>/<shards>;heads=a:b/n``), so a TP-2
engine and a TP-1 engine of one model never read each other's slices as their own. Ranks
that hold the same heads (more ranks than KV heads) share one slice; the first of them
writes it. MLA's latent is not split by heads: every rank holds all of it, so it is one
slice (``heads=latent``) that TP rank 0 writes and every rank loads.

The logical page is the same whatever physical layout vLLM chose (VLLM_KV_CACHE_LAYOUT), so
instances with different layouts share blocks. Who does what::

    scheduler process                              each worker process
    get_num_new_matched_tokens: contains() of the  start_load_kv: land_batch the step's loads
      request's next blocks, all TP ranks; the       into landing-pool slots (the local nodes
      leading run that every rank has is loaded      write their shards there), without waiting
    update_state_after_alloc: the block ids        wait_for_layer_load(layer): until that
    build_connector_meta: loads, and the blocks      layer of every block is in the paged KV
      this step fills, to save                       (engine_adapter/integrations/layer_loads.py)
                                                   save_kv_layer(layer): copy that layer of the
                                                     step's newly full blocks out to staging
                                                   wait_for_save: put_batch the staged blocks
                                                     in the background (a full pool skips)
                                                   get_block_ids_with_load_errors: blocks that
                                                     did not land, or not verified

Loads, ``load_mode`` in kv_connector_extra_config:

- ``"layerwise"`` (the default): ``load_kv_async`` False. The request runs in the step its
  load starts in; the load overlaps that step's forward pass, layer by layer: attention of
  layer l waits only for layer l. At the end of the step (``get_block_ids_with_load_errors``)
  every block the forward pass used has been verified, or is reported to vLLM, which then
  drops the step's output of the requests that used it and recomputes from that block. vLLM
  runs CUDA graphs piecewise with it (``requires_piecewise_for_cudagraph``): the per-layer
  waits must run.
- ``"async"``: ``load_kv_async`` True. The request waits (WAITING_FOR_REMOTE_KVS) while its
  blocks load between steps, overlapping other requests' steps; ``get_finished`` reports it
  once every block is verified and in the paged KV, blocks that failed in the same step. No
  step ever waits for the store; the request starts a step later.

A block the store cannot deliver is computed, in both modes (``kv_load_failure_policy:
"recompute"``). Saves copy each layer out after the forward pass computed it and leave the
step once the last layer is copied; the put runs in the background.

What an operator sees in vLLM itself: ``get_kv_connector_stats`` (``KVStoreConnectorStats``:
lookups, hit and missed blocks, loaded and saved blocks and bytes, load seconds; vLLM logs
them as "KV Transfer metrics" and exports them as ``vllm:kvstore_*`` Prometheus counters),
and KV events (``BlockStored``, medium ``STORAGE``, once every rank's slice of a block is
stored) through vLLM's KV event publisher.

Not supported (raise at start-up): hybrid models (several KV cache groups, sliding window or
Mamba layers), sparse or compressed MLA states (DeepSeek-V4: several tokens per state) and
pipeline parallelism.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from client.landing_pool import LandingPool
from client.sync_client import SyncKVClient
from engine_adapter.integrations.adapter_config import AdapterConfig
from engine_adapter.integrations.vllm.events import KVStoreKVEvents
from engine_adapter.integrations.vllm.metadata import KVStoreConnectorMetadata
from engine_adapter.integrations.vllm.scheduler_side import SchedulerSide
from engine_adapter.integrations.vllm.slices import kv_slices, tp_rank
from engine_adapter.integrations.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics
from engine_adapter.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kv_connector_extra_config keys of this connector beyond AdapterConfig's.
CHUNK_BLOCKS_KEY = "chunk_blocks"  # blocks per land_batch / put_batch (default 16)
LOAD_SLOTS_KEY = "load_slots"  # chunks of landing-pool slots for loads in flight (default 4)
SAVE_SLOTS_KEY = "save_slots"  # staging chunks for saves in flight (default 4)
SAVE_DECODE_KEY = "save_decode"  # also save blocks filled by generated tokens (default False)
LOAD_MODE_KEY = "load_mode"  # "layerwise" (default) or "async": see the module doc
LOAD_MODES = ("layerwise", "async")
OWN_KEYS = (CHUNK_BLOCKS_KEY, LOAD_SLOTS_KEY, SAVE_SLOTS_KEY, SAVE_DECODE_KEY, LOAD_MODE_KEY)
WHERE = "--kv-transfer-config kv_connector_extra_config"


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector over a kvstore cluster (see the module doc)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        self.store_config = AdapterConfig.from_mapping(extra, where=WHERE, known_elsewhere=OWN_KEYS)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_blocks = int(extra.get(CHUNK_BLOCKS_KEY, 16))
        self.save_decode = bool(extra.get(SAVE_DECODE_KEY, False))
        self.load_mode = _load_mode(extra)
        num_load_slots = int(extra.get(LOAD_SLOTS_KEY, 4))
        num_save_slots = int(extra.get(SAVE_SLOTS_KEY, 4))
        if min(self.chunk_blocks, num_load_slots, num_save_slots) <= 0:
            raise ValueError(f"{WHERE}: {OWN_KEYS[:3]} must be > 0")
        model = self.store_config.model_id or vllm_config.model_config.model
        # fp8 caches are stored as they are; e4m3x16 of others is quantised on the way out
        stored_dtype = functools.partial(self.store_config.stored_kv_format, quantizes=True)
        self.layer_names, self.layer_page_bytes, self.slices = kv_slices(
            vllm_config, kv_cache_config, model, stored_dtype
        )
        self.block_bytes = self.layer_page_bytes * len(self.layer_names)
        self.namespaces = list(dict.fromkeys(kv_slice.namespace for kv_slice in self.slices))
        self.stats = KVStoreConnectorStats()
        self.is_producer = self._kv_transfer_config.is_kv_producer
        self.is_consumer = self._kv_transfer_config.is_kv_consumer
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a KV block the store cannot deliver fails its "
                'request; set "kv_load_failure_policy":"recompute" to compute it instead',
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # Workers load into a landing pool the local nodes write into (client/landing_pool.py).
        landing_pool = None
        if role == KVConnectorRole.WORKER:
            landing_pool = LandingPool(self.block_bytes, num_load_slots * self.chunk_blocks)
        self.kv: SyncKVClient = self.store_config.connect(landing_pool=landing_pool)
        self.salt_prefix = self.store_config.tenant.encode() + b"\0"
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self)
        else:
            assert landing_pool is not None
            rank = tp_rank(vllm_config)
            self._worker = WorkerSide(self, self.slices[rank], rank, landing_pool, num_save_slots)

    def salt_of(self, request: Request) -> bytes:
        return self.salt_prefix + (request.cache_salt or "").encode()

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store holds for every TP rank (whole
        blocks, never the prompt's last token), and whether they load asynchronously
        (``load_mode`` "async"; "layerwise" loads during the request's first step)."""
        num_tokens = self._scheduler.num_matched_tokens(request, num_computed_tokens)
        return num_tokens, num_tokens > 0 and self.load_mode == "async"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.plan_load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves copy their bytes out within the step, so the blocks can be freed now."""
        self._scheduler.forget(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Collect the workers' stored-block reports (see ``take_events``)."""
        events = connector_output.kv_cache_events
        if isinstance(events, KVStoreKVEvents):
            self._scheduler.collect_stored(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored`` (medium STORAGE) for each block every slice of which is stored."""
        return self._scheduler.take_stored()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counters (scheduler: lookups; worker: loads and saves), reset."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVStoreConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait inside the forward pass: no full CUDA graph may skip that."""
        return _load_mode(extra_config) == "layerwise"

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # Worker side.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads (land_batch into landing-pool slots) without waiting."""
        self._worker.start_loads(self._meta().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise loads: until this layer of every block loading is in the paged KV.
        (Async loads are complete before their request runs: nothing to wait for.)"""
        if self.load_mode == "layerwise":
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy this layer of the step's newly full blocks out of the paged KV (the forward
        pass has just computed it)."""
        self._worker.save_layer(layer_name, self._meta().saves)

    def wait_for_save(self) -> None:
        """Copy out the layers ``save_kv_layer`` did not see, then put the step's full blocks
        in the background."""
        self._worker.save(self._meta().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that are over (every block verified in the paged KV, or failed: see
        get_block_ids_with_load_errors, same step). Saves never hold blocks past a step."""
        if self.load_mode != "async":
            return None, None
        return None, self._worker.take_finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks planned for loading that did not land or did not verify: vLLM computes them
        instead. Layer-wise loads end here, at the end of their step: every block the forward
        pass read is verified by now, or named here."""
        if self.load_mode == "layerwise":
            self._worker.finish_loads()
        return self._worker.take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """The blocks whose puts this worker saw land since the last step."""
        stored = self._worker.take_stored_events()
        return KVStoreKVEvents(stored) if stored else None

    def shutdown(self) -> None:
        """Wait for background saves, cancel loads, then close the store client."""
        if self.role == KVConnectorRole.WORKER:
            self._worker.drain()
            self._worker.close_loads()
        self.kv.close()
        if self.role == KVConnectorRole.WORKER:
            self._worker.landing_pool.close()

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        return meta


def _load_mode(extra: dict[str, Any]) -> str:
    mode = extra.get(LOAD_MODE_KEY, "layerwise")
    if mode not in LOAD_MODES:
        raise ValueError(f"{WHERE}: {LOAD_MODE_KEY} {mode!r} is not one of {LOAD_MODES}")
    return mode
