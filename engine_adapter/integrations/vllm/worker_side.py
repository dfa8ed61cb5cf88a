"""The connector's worker side: moves blocks between the paged KV and the store."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from client.buffer_pool import BufferPool, BufferSlot
from engine_adapter.connector import StoreFailure
from engine_adapter.host_buffers import host_memory
from engine_adapter.integrations.layer_loads import BlockLoad, LayerLoads, PagedLayer
from engine_adapter.integrations.vllm.events import stored_events
from engine_adapter.kv_layout import E4M3X16_ENCODING
from kvstore.errors import QuorumError

if TYPE_CHECKING:
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent

    from client.landing_pool import LandingPool
    from engine_adapter.integrations.vllm.connector import KVStoreConnector
    from engine_adapter.integrations.vllm.metadata import BlockTransfer
    from engine_adapter.integrations.vllm.slices import KVSlice

log = logging.getLogger(__name__)


class WorkerSide:
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
        quantized = self.namespace.dtype == E4M3X16_ENCODING
        self._layers = [
            PagedLayer(kv_caches[name], num_blocks, quantized) for name in self.c.layer_names
        ]
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
            events = stored_events(transfer, self.c.block_size)
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


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
