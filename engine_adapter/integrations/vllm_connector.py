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

import concurrent.futures
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from client.buffer_pool import BufferPool, BufferSlot
from client.landing_pool import LandingPool
from client.sync_client import SyncKVClient
from engine_adapter.connector import StoreFailure
from engine_adapter.engine_keys import EngineKeyNamespace
from engine_adapter.host_buffers import host_memory
from engine_adapter.integrations.adapter_config import AdapterConfig
from engine_adapter.integrations.layer_loads import BlockLoad, LayerLoads, PagedLayer
from kvstore.errors import QuorumError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
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
MAX_PENDING_REPORTS = 100_000  # stored-block reports waiting for the other slices' writers


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: vLLM block hashes and the paged block ids
    (saves also carry what a ``BlockStored`` event names: the parent hash and the tokens)."""

    req_id: str
    block_hashes: list[bytes]
    salt: bytes  # tenant and cache_salt (engine_adapter/engine_keys.py)
    block_ids: list[int]
    parent_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KVSlice:
    """The part of each block's KV one TP rank holds, and the key namespace that names it."""

    namespace: EngineKeyNamespace
    writer_rank: int  # the first TP rank holding this slice writes it


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


class KVStoreKVEvents(KVConnectorKVEvents):
    """``BlockStored`` events of one step, from one or (after vLLM merges them) all workers."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self.events = list(events or [])
        self.num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events += events

    def aggregate(self) -> KVStoreKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events = []


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


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(frozen=True)
class _Lookup:
    first: int  # the first block the store may provide
    num_hits: int  # leading blocks every slice of which is stored
    num_asked: int


@dataclass
class _Tracked:
    """A running request the scheduler side saves blocks of."""

    request: Request
    block_ids: list[int]
    num_saved_blocks: int


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
        self.layer_names, self.layer_page_bytes, self.slices = _slices(
            vllm_config, kv_cache_config, model
        )
        self.block_bytes = self.layer_page_bytes * len(self.layer_names)
        self.store_config.stored_kv_format(self.slices[0].namespace.dtype)  # fp8: as is
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
            self._scheduler = _SchedulerSide(self)
        else:
            assert landing_pool is not None
            rank = _tp_rank(vllm_config)
            self._worker = _WorkerSide(self, self.slices[rank], rank, landing_pool, num_save_slots)

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


class _SchedulerSide:
    """Lookup, load plans and save plans (runs in vLLM's scheduler)."""

    def __init__(self, connector: KVStoreConnector) -> None:
        self.c = connector
        self._requests: dict[str, Request] = {}  # every request seen, until it finishes
        self._lookups: dict[str, _Lookup] = {}  # req_id -> its latest lookup
        self._pending_loads: list[BlockTransfer] = []
        self._tracked: dict[str, _Tracked] = {}
        # BlockStored -> how many slice writers reported it; out once every slice did.
        self._stored_reports: Counter[KVCacheEvent] = Counter()
        self._stored: list[KVCacheEvent] = []

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        c, block_size = self.c, self.c.block_size
        self._requests[request.request_id] = request
        first = num_computed_tokens // block_size
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // block_size)
        if not c.is_consumer or usable <= first:
            return 0
        hashes = [bytes(h) for h in request.block_hashes[first:usable]]
        salt = c.salt_of(request)
        keys = [key for ns in c.namespaces for key in ns.keys(hashes, salt)]
        num_hashes = len(hashes)
        try:
            present = c.kv.contains(keys)
        except StoreFailure as exc:  # a lookup that fails is a miss
            log.warning("kvstore lookup failed, computing request %s: %s", request.request_id, exc)
            present = [False] * len(keys)
        # contains() answers slice after slice; a block counts when every slice is there.
        num_hits = 0
        while num_hits < num_hashes and all(present[num_hits::num_hashes]):
            num_hits += 1
        self._lookups[request.request_id] = _Lookup(first, num_hits, num_hashes)
        return num_hits * block_size

    def plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called once the request's blocks are allocated: count its lookup, plan its load."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        num_misses = lookup.num_asked - lookup.num_hits
        self.c.stats.add(num_lookups=1, hit_blocks=lookup.num_hits, miss_blocks=num_misses)
        if num_external_tokens <= 0:
            return
        first, num_blocks = lookup.first, num_external_tokens // self.c.block_size
        block_ids = blocks.get_block_ids()[0][first : first + num_blocks]
        hashes = [bytes(h) for h in request.block_hashes[first : first + num_blocks]]
        salt = self.c.salt_of(request)
        self._pending_loads.append(BlockTransfer(request.request_id, hashes, salt, block_ids))

    def build_meta(self, out: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        for new in out.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            num_saved = new.num_computed_tokens // self.c.block_size  # local and loaded hits
            tracked = _Tracked(request, list(new.block_ids[0]), num_saved)
            self._tracked[new.req_id] = tracked
            num_done = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            self._plan_save(meta, tracked, num_done)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_block_ids is not None:
                tracked.block_ids = list(new_block_ids[0])  # preempted: all blocks are new
            elif new_block_ids is not None:
                tracked.block_ids.extend(new_block_ids[0])
            num_done = cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id]
            self._plan_save(meta, tracked, num_done)
        return meta

    def _plan_save(
        self, meta: KVStoreConnectorMetadata, tracked: _Tracked, num_done_tokens: int
    ) -> None:
        """Save the blocks that are full once this step has computed ``num_done_tokens``."""
        if not self.c.is_producer:
            return
        request, block_size = tracked.request, self.c.block_size
        end = min(num_done_tokens // block_size, len(request.block_hashes), len(tracked.block_ids))
        if not self.c.save_decode:
            end = min(end, request.num_prompt_tokens // block_size)
        start = tracked.num_saved_blocks
        if end <= start:
            return
        hashes = [bytes(h) for h in request.block_hashes[start:end]]
        salt = self.c.salt_of(request)
        block_ids = tracked.block_ids[start:end]
        parent = bytes(request.block_hashes[start - 1]) if start else None
        tokens = list(request.all_token_ids[start * block_size : end * block_size])
        transfer = BlockTransfer(request.request_id, hashes, salt, block_ids, parent, tokens)
        meta.saves.append(transfer)
        tracked.num_saved_blocks = end

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._tracked.pop(req_id, None)
        self._lookups.pop(req_id, None)

    def collect_stored(self, events: list[KVCacheEvent]) -> None:
        """Count the workers' reports; a block is stored once every slice writer reported."""
        self._stored_reports.update(events)
        num_slices = len(self.c.namespaces)
        done = [event for event, count in self._stored_reports.items() if count >= num_slices]
        for event in done:
            del self._stored_reports[event]
        self._stored += done
        if len(self._stored_reports) > MAX_PENDING_REPORTS:  # a writer's puts keep failing
            self._stored_reports.clear()

    def take_stored(self) -> list[KVCacheEvent]:
        stored, self._stored = self._stored, []
        return stored


class _WorkerSide:
    """Moves blocks between the paged KV and the store (runs in each vLLM worker)."""

    def __init__(
        self,
        connector: KVStoreConnector,
        kv_slice: KVSlice,
        tp_rank: int,
        landing_pool: LandingPool,
        num_save_slots: int,
    ) -> None:
        self.c = connector
        self.namespace = kv_slice.namespace
        self.writes = tp_rank == kv_slice.writer_rank  # one writer per slice (MLA: rank 0)
        self.landing_pool = landing_pool  # loads land here (the client was given it)
        self._num_save_slots = num_save_slots
        self._layers: list[PagedLayer] = []
        self._layer_index = {name: i for i, name in enumerate(connector.layer_names)}
        self._loads: LayerLoads | None = None
        self._save_pool: BufferPool | None = None
        self._save_stream: torch.cuda.Stream | None = None  # CUDA: saves copy out on it
        self._staged: _StagedSaves | None = None  # this step's saves, from the first layer on
        self._saves: list[tuple[concurrent.futures.Future[Any], BufferSlot, list[_Block]]] = []
        self._load_errors: set[int] = set()
        self._stored_events: list[KVCacheEvent] = []
        self.num_saves_skipped = 0  # blocks not saved: every save slot was in flight

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.c.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KVStoreConnector: no KV cache tensor for layers {missing}")
        num_blocks = self.c._kv_cache_config.num_blocks
        self._layers = [PagedLayer(kv_caches[name], num_blocks) for name in self.c.layer_names]
        block_bytes = sum(layer.page_bytes for layer in self._layers)
        if block_bytes != self.c.block_bytes:
            raise ValueError(
                f"KVStoreConnector: the paged KV holds {block_bytes} bytes per block but the KV "
                f"cache spec says {self.c.block_bytes}; this vLLM's KV cache views are not "
                "[B, H, N, C]"
            )
        device = self._layers[0].tensor.device
        pin = device.type == "cuda"
        self._loads = LayerLoads(self.c.kv, self.landing_pool, self._layers, self.c.chunk_blocks)
        allocate = functools.partial(host_memory, pin_memory=pin)
        slot_bytes = block_bytes * self.c.chunk_blocks
        self._save_pool = BufferPool(slot_bytes, self._num_save_slots, allocate=allocate)
        if pin:
            self._save_stream = torch.cuda.Stream(device=device)
        self.block_bytes = block_bytes

    # Loads (engine_adapter/integrations/layer_loads.py).
    def start_loads(self, transfers: Sequence[BlockTransfer]) -> None:
        loads = self._require_loads()
        for transfer in transfers:
            keys = self.namespace.keys(transfer.block_hashes, transfer.salt)
            loads.start(transfer.req_id, keys, transfer.block_ids)
        loads.progress()

    def wait_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)  # a draft model's layers are not ours
        if layer is not None and self._loads is not None:
            self._loads.wait_layer(layer)

    def finish_loads(self) -> None:
        """Wait for every load in flight (layer-wise: the end of their step)."""
        if self._loads is not None:
            self._record(self._loads.finish())

    def take_finished_loads(self) -> set[str]:
        """The requests whose loads are over (async), without waiting."""
        if self._loads is None:
            return set()
        self._loads.progress()
        finished = self._loads.take_finished()
        self._record(finished)
        return {load.req_id for load in finished}

    def _record(self, loads: list[BlockLoad]) -> None:
        for load in loads:
            self._load_errors |= load.failed
            num_loaded = len(load.keys) - len(load.failed)
            if load.failed:
                log.warning(
                    "request %s: %d of %d KV blocks did not load from kvstore; vLLM computes them",
                    load.req_id,
                    len(load.failed),
                    len(load.keys),
                )
            self.c.stats.add(
                num_loads=1,
                loaded_blocks=num_loaded,
                loaded_bytes=num_loaded * self.block_bytes,
                load_failed_blocks=len(load.failed),
                load_s=load.finished_s - load.started_s,
            )

    def _require_loads(self) -> LayerLoads:
        assert self._loads is not None, "register_kv_caches was not called"
        return self._loads

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close_loads(self) -> None:
        if self._loads is not None:
            self._loads.close()

    # Saves.
    def save_layer(self, layer_name: str, transfers: Sequence[BlockTransfer]) -> None:
        """Copy one layer of the step's blocks to save out to their staging slots."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not transfers or not self.writes:
            return
        staged = self._stage(transfers)
        if layer not in staged.copied:
            self._copy_out(staged, layer)

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """The step's end: copy out the layers save_layer did not, put the staged blocks in
        the background."""
        self._reap_saves(wait=False)
        staged, self._staged = self._staged, None
        if staged is None and transfers and self.writes:
            staged = self._stage(transfers)
            self._staged = None
        if staged is None:
            return
        for layer in range(len(self._layers)):
            if layer not in staged.copied:
                self._copy_out(staged, layer)
        if self._save_stream is not None:
            self._save_stream.synchronize()  # the copies must finish first
        traffic_class = self.c.store_config.traffic_class
        for chunk, slot in staged.chunks:
            keys = [block.key for block in chunk]
            views = self._block_views(slot, len(chunk))
            future = self.c.kv.submit("put_batch", keys, views, traffic_class=traffic_class)
            self._saves.append((future, slot, chunk))

    def _stage(self, transfers: Sequence[BlockTransfer]) -> _StagedSaves:
        """This step's blocks to save in free save slots (once per step; a store slower than
        the engine skips blocks: best effort)."""
        if self._staged is not None:
            return self._staged
        self._reap_saves(wait=False)
        assert self._save_pool is not None, "register_kv_caches was not called"
        chunks = _chunks(self._store_blocks(transfers), self.c.chunk_blocks)
        staged = _StagedSaves()
        for position, chunk in enumerate(chunks):
            slot = self._save_pool.try_acquire()
            if slot is None:
                num_skipped = sum(len(rest) for rest in chunks[position:])
                self.num_saves_skipped += num_skipped
                self.c.stats.add(save_skipped_blocks=num_skipped)
                log.warning("kvstore saves are behind: %d KV blocks not saved", num_skipped)
                break
            staged.chunks.append((chunk, slot))
        self._staged = staged
        return staged

    def _copy_out(self, staged: _StagedSaves, layer: int) -> None:
        """Layer ``layer`` of the staged blocks: paged KV -> staging (CUDA: on the save
        stream, after the compute that wrote it)."""
        paged = self._layers[layer]
        start = layer * paged.page_bytes
        stream = self._save_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(paged.tensor.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for chunk, slot in staged.chunks:
                staging = self._staging(slot, len(chunk))[:, start : start + paged.page_bytes]
                block_ids = [block.block_id for block in chunk]
                paged.read(block_ids, staging, non_blocking=stream is not None)
        staged.copied.add(layer)

    def _reap_saves(self, *, wait: bool) -> None:
        still = []
        for future, slot, chunk in self._saves:
            if not wait and not future.done():
                still.append((future, slot, chunk))
                continue
            failed: set[bytes] = set()
            try:
                future.result()
            except QuorumError as exc:
                failed = set(exc.keys)
                log.warning("saving %d of %d KV blocks failed: %s", len(failed), len(chunk), exc)
            except StoreFailure as exc:
                failed = {block.key for block in chunk}
                log.warning("saving %d KV blocks failed: %s", len(chunk), exc)
            slot.release()
            stored = [block for block in chunk if block.key not in failed]
            self._stored_events += [block.stored for block in stored if block.stored]
            self.c.stats.add(
                saved_blocks=len(stored),
                saved_bytes=len(stored) * self.block_bytes,
                save_failed_blocks=len(chunk) - len(stored),
            )
        self._saves = still

    def drain(self) -> None:
        self._reap_saves(wait=True)

    def take_stored_events(self) -> list[KVCacheEvent]:
        self._reap_saves(wait=False)
        events, self._stored_events = self._stored_events, []
        return events

    def _store_blocks(self, transfers: Sequence[BlockTransfer]) -> list[_Block]:
        """Every block of ``transfers``: its store key, block id and (saves) its event."""
        blocks = []
        for transfer in transfers:
            keys = self.namespace.keys(transfer.block_hashes, transfer.salt)
            events = _stored_events(transfer, self.c.block_size)
            blocks += map(_Block, keys, transfer.block_ids, events)
        return blocks

    def _staging(self, slot: BufferSlot, num_blocks: int) -> torch.Tensor:
        memory = torch.frombuffer(slot.view, dtype=torch.uint8)
        return memory[: num_blocks * self.block_bytes].view(num_blocks, self.block_bytes)

    def _block_views(self, slot: BufferSlot, num_blocks: int) -> list[memoryview]:
        size = self.block_bytes
        return [slot.view[i * size : (i + 1) * size] for i in range(num_blocks)]


@dataclass
class _StagedSaves:
    """A step's blocks to save, in staging slots, and the layers copied out so far."""

    chunks: list[tuple[list[_Block], BufferSlot]] = field(default_factory=list)
    copied: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Block:
    key: bytes  # the store key
    block_id: int  # vLLM's paged block id
    stored: BlockStored | None  # the event once its put landed (saves only)


def _stored_events(transfer: BlockTransfer, block_size: int) -> list[BlockStored | None]:
    """One BlockStored per saved block (parent: the block before it); none for loads."""
    if not transfer.token_ids:
        return [None] * len(transfer.block_hashes)
    parents = [transfer.parent_hash, *transfer.block_hashes[:-1]]
    return [
        BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=parent,
            token_ids=transfer.token_ids[i * block_size : (i + 1) * block_size],
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM_STORAGE,
            lora_name=None,
        )
        for i, (block_hash, parent) in enumerate(zip(transfer.block_hashes, parents, strict=True))
    ]


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _load_mode(extra: dict[str, Any]) -> str:
    mode = extra.get(LOAD_MODE_KEY, "layerwise")
    if mode not in LOAD_MODES:
        raise ValueError(f"{WHERE}: {LOAD_MODE_KEY} {mode!r} is not one of {LOAD_MODES}")
    return mode


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's TP rank: from vLLM's TP group once it exists, else from the worker's
    global rank (``parallel_config.rank``, which vLLM's WorkerBase sets; TP varies fastest)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1:
        return 0
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return parallel.rank % parallel.tensor_parallel_size


def _check_spec(kv_cache_config: KVCacheConfig) -> FullAttentionSpec:
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ValueError(
            "KVStoreConnector supports models whose layers are all full attention (or all "
            f"MLA) with one KV cache group; got {[type(g.kv_cache_spec).__name__ for g in groups]}"
            " (sliding-window and hybrid models are not supported yet)"
        )
    if spec.tokens_per_state != 1 or getattr(spec, "model_version", None):
        raise ValueError(
            "KVStoreConnector supports one KV state per token; this model's MLA cache holds "
            f"{spec.tokens_per_state} tokens per state (DeepSeek-V4-style sparse MLA)"
        )
    return spec


def _slices(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model: str
) -> tuple[list[str], int, list[KVSlice]]:
    """The layers in store-block order, the bytes of one layer's page of a block, and each
    TP rank's slice (several ranks may share one: see the module doc)."""
    spec = _check_spec(kv_cache_config)
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KVStoreConnector does not support pipeline parallelism yet")
    if vllm_config.model_config.revision:
        model += f"@{vllm_config.model_config.revision}"
    layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
    channels = spec.state_content_size_bytes // torch.empty((), dtype=spec.dtype).element_size()
    layer_page_bytes = spec.num_heads * spec.block_size * spec.state_content_size_bytes
    shape = f"{len(layer_names)}x{spec.num_heads}x{spec.block_size}x{channels}"
    extra = (
        ("cache_dtype", str(vllm_config.cache_config.cache_dtype)),
        ("kv_quant", str(spec.kv_quant_mode.name)),
    )
    tp_size = parallel.tensor_parallel_size
    mla = isinstance(spec, MLAAttentionSpec)
    total_heads = 1 if mla else vllm_config.model_config.get_total_num_kv_heads()
    slices: list[KVSlice] = []
    for rank in range(tp_size):
        first, end = _head_range(rank, tp_size, total_heads)
        shard, num_shards = (first, total_heads) if tp_size > total_heads else (rank, tp_size)
        writer = next(r for r in range(tp_size) if _head_range(r, tp_size, total_heads)[0] == first)
        namespace = EngineKeyNamespace(
            engine="vllm",
            model=model,
            dtype=str(spec.dtype).removeprefix("torch."),
            layout=f"vllm-{'MLA' if mla else 'BHNC'}-v1:{shape}",
            page_tokens=spec.block_size,
            tp_rank=shard,
            tp_size=num_shards,
            extra=(("heads", "latent" if mla else f"{first}:{end}/{total_heads}"), *extra),
        )
        slices.append(KVSlice(namespace, writer))
    return layer_names, layer_page_bytes, slices


def _head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """KV heads [first, end) a TP rank holds: an equal share, or one replicated head when
    there are more ranks than heads (vLLM's split). MLA's latent: one "head", replicated."""
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * total_heads // tp_size
    return head, head + 1
