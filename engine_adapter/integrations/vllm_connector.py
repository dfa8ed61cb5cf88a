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
namespace of the model, KV dtype, layout with its shape, block size and TP rank
(engine_adapter/engine_keys.py)::

    store block = [layer 0 | layer 1 | ... | layer L-1]      layers in kv_cache_groups order
    layer       = vLLM's logical [H, N, C] page of the block   H heads, N = block_size tokens,
                                                              C = K and V of a head, C order

The logical page is the same whatever physical layout vLLM chose (VLLM_KV_CACHE_LAYOUT), so
instances with different layouts share blocks. Who does what::

    scheduler process                              each worker process
    get_num_new_matched_tokens: contains() of the  start_load_kv: get_batch_into staging slots,
      request's next blocks, all TP ranks; the       scatter into the paged KV; blocks that did
      leading run that every rank has is loaded      not land -> get_block_ids_with_load_errors
    update_state_after_alloc: the block ids        wait_for_save: gather the step's newly full
    build_connector_meta: loads, and the blocks      blocks into staging slots, put_batch in the
      this step fills, to save                       background (best effort; a full pool skips)

Loads are synchronous (``load_kv_async`` False): they finish in ``start_load_kv``, before the
forward pass. Saves leave the step as soon as the bytes are copied out of the paged KV.
Not supported (raise at start-up): MLA, hybrid models (several KV cache groups, sliding
window or Mamba layers) and pipeline parallelism.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from client.buffer_pool import BufferPool, BufferSlot
from client.sync_client import SyncKVClient
from engine_adapter.connector import StoreFailure
from engine_adapter.engine_keys import EngineKeyNamespace
from engine_adapter.host_buffers import host_memory
from engine_adapter.integrations.adapter_config import AdapterConfig
from kvstore.errors import QuorumError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kv_connector_extra_config keys of this connector beyond AdapterConfig's.
CHUNK_BLOCKS_KEY = "chunk_blocks"  # blocks per get_batch_into / put_batch (default 16)
LOAD_SLOTS_KEY = "load_slots"  # staging chunks for loads in flight (default 4)
SAVE_SLOTS_KEY = "save_slots"  # staging chunks for saves in flight (default 4)
SAVE_DECODE_KEY = "save_decode"  # also save blocks filled by generated tokens (default False)
OWN_KEYS = (CHUNK_BLOCKS_KEY, LOAD_SLOTS_KEY, SAVE_SLOTS_KEY, SAVE_DECODE_KEY)
WHERE = "--kv-transfer-config kv_connector_extra_config"


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: vLLM block hashes and the paged block ids."""

    req_id: str
    block_hashes: list[bytes]
    salt: bytes  # tenant and cache_salt (engine_adapter/engine_keys.py)
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


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
        model = self.store_config.model_id or vllm_config.model_config.model
        self.layer_names, self.layer_page_bytes, self.namespaces = _namespaces(
            vllm_config, kv_cache_config, model
        )
        self.is_producer = self._kv_transfer_config.is_kv_producer
        self.is_consumer = self._kv_transfer_config.is_kv_consumer
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a KV block the store cannot deliver fails its "
                'request; set "kv_load_failure_policy":"recompute" to compute it instead',
                self._kv_transfer_config.kv_load_failure_policy,
            )
        self.kv: SyncKVClient = self.store_config.connect()
        self.salt_prefix = self.store_config.tenant.encode() + b"\0"
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(
                self,
                self.namespaces[_tp_rank(vllm_config)],
                int(extra.get(LOAD_SLOTS_KEY, 4)),
                int(extra.get(SAVE_SLOTS_KEY, 4)),
            )

    def salt_of(self, request: Request) -> bytes:
        return self.salt_prefix + (request.cache_salt or "").encode()

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store holds for every TP rank (whole
        blocks, never the prompt's last token); loads are synchronous."""
        return self._scheduler.num_matched_tokens(request, num_computed_tokens), False

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

    # Worker side.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's planned blocks into the paged KV (before the forward pass)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv loaded every layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: one store block holds all layers, saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Copy this step's full blocks out of the paged KV and put them in the background."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        self._worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Neither loads nor saves outlive a step: nothing is ever pending here."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks planned for loading that did not land: vLLM computes them instead."""
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        """Wait for background saves, then close the store client."""
        if self.role == KVConnectorRole.WORKER:
            self._worker.drain()
        self.kv.close()


class _SchedulerSide:
    """Lookup, load plans and save plans (runs in vLLM's scheduler)."""

    def __init__(self, connector: KVStoreConnector) -> None:
        self.c = connector
        self._requests: dict[str, Request] = {}  # every request seen, until it finishes
        self._lookups: dict[str, int] = {}  # req_id -> first block the store may provide
        self._pending_loads: list[BlockTransfer] = []
        self._tracked: dict[str, _Tracked] = {}

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
        try:
            present = c.kv.contains(keys)
        except StoreFailure as exc:  # a lookup that fails is a miss
            log.warning("kvstore lookup failed, computing request %s: %s", request.request_id, exc)
            return 0
        # contains() answers rank after rank; a block counts when every TP rank has it.
        num_hashes = len(hashes)
        num_hits = 0
        while num_hits < num_hashes and all(present[num_hits::num_hashes]):
            num_hits += 1
        self._lookups[request.request_id] = first
        return num_hits * block_size

    def plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        first = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or first is None:
            return
        num_blocks = num_external_tokens // self.c.block_size
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
        meta.saves.append(BlockTransfer(request.request_id, hashes, salt, block_ids))
        tracked.num_saved_blocks = end

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._tracked.pop(req_id, None)
        self._lookups.pop(req_id, None)


class _WorkerSide:
    """Moves blocks between the paged KV and the store (runs in each vLLM worker)."""

    def __init__(
        self,
        connector: KVStoreConnector,
        namespace: EngineKeyNamespace,
        num_load_slots: int,
        num_save_slots: int,
    ) -> None:
        if min(connector.chunk_blocks, num_load_slots, num_save_slots) <= 0:
            raise ValueError(f"{WHERE}: {OWN_KEYS[:3]} must be > 0")
        self.c = connector
        self.namespace = namespace
        self._num_slots = (num_load_slots, num_save_slots)
        self._layers: list[_PagedLayer] = []
        self._load_pool: BufferPool | None = None
        self._save_pool: BufferPool | None = None
        self._saves: list[tuple[concurrent.futures.Future[Any], BufferSlot, int]] = []
        self._load_errors: set[int] = set()
        self.num_saves_skipped = 0  # blocks not saved: every save slot was in flight

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.c.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KVStoreConnector: no KV cache tensor for layers {missing}")
        num_blocks = self.c._kv_cache_config.num_blocks
        self._layers = [_PagedLayer(kv_caches[name], num_blocks) for name in self.c.layer_names]
        block_bytes = sum(layer.page_bytes for layer in self._layers)
        expected = self.c.layer_page_bytes * len(self._layers)
        if block_bytes != expected:
            raise ValueError(
                f"KVStoreConnector: the paged KV holds {block_bytes} bytes per block but the KV "
                f"cache spec says {expected}; this vLLM's KV cache views are not [B, H, N, C]"
            )
        pin = self._layers[0].tensor.device.type == "cuda"
        slot_bytes = block_bytes * self.c.chunk_blocks
        load_slots, save_slots = self._num_slots
        allocate = functools.partial(host_memory, pin_memory=pin)
        self._load_pool = BufferPool(slot_bytes, load_slots, allocate=allocate)
        self._save_pool = BufferPool(slot_bytes, save_slots, allocate=allocate)
        self.block_bytes = block_bytes

    def load(self, transfers: Sequence[BlockTransfer]) -> None:
        """get_batch_into staging chunks (several in flight), scatter what landed."""
        blocks = self._store_blocks(transfers)
        if not blocks:
            return
        assert self._load_pool is not None, "register_kv_caches was not called"
        chunks = _chunks(blocks, self.c.chunk_blocks)
        while chunks:
            in_flight = []
            while chunks and (slot := self._load_pool.try_acquire()) is not None:
                chunk = chunks.pop(0)
                views = self._block_views(slot, len(chunk))
                keys = [key for key, _ in chunk]
                in_flight.append((chunk, slot, self.c.kv.submit("get_batch_into", keys, views)))
            for chunk, slot, future in in_flight:
                try:
                    self._scatter(chunk, slot, self._landed(future, len(chunk)))
                finally:
                    slot.release()

    def _landed(self, future: concurrent.futures.Future[list[bool]], num_blocks: int) -> list[bool]:
        try:
            return future.result()
        except StoreFailure as exc:  # the blocks are computed instead (get_block_ids...)
            log.warning("loading %d KV blocks from kvstore failed: %s", num_blocks, exc)
            return [False] * num_blocks

    def _scatter(
        self, chunk: list[tuple[bytes, int]], slot: BufferSlot, landed: list[bool]
    ) -> None:
        positions = [i for i, ok in enumerate(landed) if ok]
        failed = (block_id for (_, block_id), ok in zip(chunk, landed, strict=True) if not ok)
        self._load_errors.update(failed)
        if not positions:
            return
        staging = self._staging(slot, len(chunk))  # [n, block_bytes]
        if len(positions) < len(chunk):
            staging = staging[positions]
        block_ids = [chunk[i][1] for i in positions]
        offset = 0
        for layer in self._layers:
            layer.write(block_ids, staging[:, offset : offset + layer.page_bytes])
            offset += layer.page_bytes

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """Gather the blocks into free save slots and put them in the background."""
        self._reap_saves(wait=False)
        blocks = self._store_blocks(transfers)
        if not blocks:
            return
        assert self._save_pool is not None, "register_kv_caches was not called"
        chunks = _chunks(blocks, self.c.chunk_blocks)
        for position, chunk in enumerate(chunks):
            slot = self._save_pool.try_acquire()
            if slot is None:  # best effort: a store slower than the engine skips blocks
                num_skipped = sum(len(rest) for rest in chunks[position:])
                self.num_saves_skipped += num_skipped
                log.warning("kvstore saves are behind: %d KV blocks not saved", num_skipped)
                return
            staging = self._staging(slot, len(chunk))
            block_ids = [block_id for _, block_id in chunk]
            offset = 0
            for layer in self._layers:
                layer.read(block_ids, staging[:, offset : offset + layer.page_bytes])
                offset += layer.page_bytes
            if self._layers[0].tensor.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the copies must finish first
            keys = [key for key, _ in chunk]
            views = self._block_views(slot, len(chunk))
            traffic_class = self.c.store_config.traffic_class
            future = self.c.kv.submit("put_batch", keys, views, traffic_class=traffic_class)
            self._saves.append((future, slot, len(chunk)))

    def _reap_saves(self, *, wait: bool) -> None:
        still = []
        for future, slot, num_blocks in self._saves:
            if not wait and not future.done():
                still.append((future, slot, num_blocks))
                continue
            try:
                future.result()
            except QuorumError as exc:
                log.warning("saving %d of %d KV blocks failed: %s", len(exc.keys), num_blocks, exc)
            except StoreFailure as exc:
                log.warning("saving %d KV blocks failed: %s", num_blocks, exc)
            slot.release()
        self._saves = still

    def drain(self) -> None:
        self._reap_saves(wait=True)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _store_blocks(self, transfers: Sequence[BlockTransfer]) -> list[tuple[bytes, int]]:
        """(store key, block id) of every block of ``transfers``."""
        blocks = []
        for transfer in transfers:
            keys = self.namespace.keys(transfer.block_hashes, transfer.salt)
            blocks += zip(keys, transfer.block_ids, strict=True)
        return blocks

    def _staging(self, slot: BufferSlot, num_blocks: int) -> torch.Tensor:
        memory = torch.frombuffer(slot.view, dtype=torch.uint8)
        return memory[: num_blocks * self.block_bytes].view(num_blocks, self.block_bytes)

    def _block_views(self, slot: BufferSlot, num_blocks: int) -> list[memoryview]:
        size = self.block_bytes
        return [slot.view[i * size : (i + 1) * size] for i in range(num_blocks)]


class _PagedLayer:
    """One layer's paged KV as vLLM hands it over: a ``[B, H, N, C]`` view, blocks first,
    any physical strides. ``B`` may count kernel blocks, ``ratio`` of them per vLLM block."""

    def __init__(self, tensor: torch.Tensor, num_blocks: int) -> None:
        if tensor.dim() != 4 or tensor.shape[0] % num_blocks:
            raise ValueError(
                f"KVStoreConnector expects [B, H, N, C] KV views with B a multiple of "
                f"{num_blocks} blocks, got shape {tuple(tensor.shape)}"
            )
        self.tensor = tensor
        self.ratio = tensor.shape[0] // num_blocks
        _, self.num_heads, self.kernel_tokens, self.num_channels = tensor.shape
        page_elements = self.ratio * self.num_heads * self.kernel_tokens * self.num_channels
        self.page_bytes = page_elements * tensor.element_size()

    def _kernel_ids(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        spread = ids[:, None] * self.ratio + torch.arange(self.ratio)  # [n, ratio]
        return spread.flatten().to(self.tensor.device)

    def _logical(self, raw: torch.Tensor) -> torch.Tensor:
        """[n, page_bytes] uint8 -> [n * ratio, H, kernel_tokens, C] of the KV dtype, as the
        paged view indexes it (a vLLM block's tokens run across its kernel blocks)."""
        n = raw.shape[0]
        heads, tokens, channels = self.num_heads, self.kernel_tokens, self.num_channels
        pages = raw.view(self.tensor.dtype).view(n, heads, self.ratio, tokens, channels)
        return pages.transpose(1, 2).reshape(n * self.ratio, heads, tokens, channels)

    def read(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copy the blocks' logical [H, N, C] pages into ``out`` ([n, page_bytes] uint8)."""
        pages = self.tensor[self._kernel_ids(block_ids)]  # [n * ratio, H, kernel_tokens, C]
        n, heads, tokens, channels = (
            len(block_ids),
            self.num_heads,
            self.kernel_tokens,
            self.num_channels,
        )
        shaped = pages.view(n, self.ratio, heads, tokens, channels)
        dst = out.view(self.tensor.dtype).view(n, heads, self.ratio, tokens, channels)
        dst.copy_(shaped.transpose(1, 2))

    def write(self, block_ids: list[int], raw: torch.Tensor) -> None:
        """Place the blocks' pages from ``raw`` ([n, page_bytes] uint8) into the paged KV."""
        self.tensor[self._kernel_ids(block_ids)] = self._logical(raw).to(self.tensor.device)


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _tp_rank(vllm_config: VllmConfig) -> int:
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _namespaces(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model: str
) -> tuple[list[str], int, list[EngineKeyNamespace]]:
    """The layers in store-block order, the bytes of one layer's page of a block, and one key
    namespace per TP rank."""
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if spec is None or type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec):
        raise ValueError(
            "KVStoreConnector supports models whose layers are all full attention with one "
            f"KV cache group; got {[type(g.kv_cache_spec).__name__ for g in groups]} "
            "(MLA, sliding-window and hybrid models are not supported yet)"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KVStoreConnector does not support pipeline parallelism yet")
    if vllm_config.model_config.revision:
        model += f"@{vllm_config.model_config.revision}"
    num_layers = len(groups[0].layer_names)
    channels = spec.state_content_size_bytes // torch.empty((), dtype=spec.dtype).element_size()
    layer_page_bytes = spec.num_heads * spec.block_size * spec.state_content_size_bytes
    shape = f"{num_layers}x{spec.num_heads}x{spec.block_size}x{channels}"
    dtype = str(spec.dtype).removeprefix("torch.")
    extra = (
        ("cache_dtype", str(vllm_config.cache_config.cache_dtype)),
        ("kv_quant", str(spec.kv_quant_mode.name)),
    )
    tp_size = parallel.tensor_parallel_size
    namespaces = [
        EngineKeyNamespace(
            engine="vllm",
            model=model,
            dtype=dtype,
            layout=f"vllm-BHNC-v1:{shape}",
            page_tokens=spec.block_size,
            tp_rank=rank,
            tp_size=tp_size,
            extra=extra,
        )
        for rank in range(tp_size)
    ]
    return list(groups[0].layer_names), layer_page_bytes, namespaces
