"""Swap-in: fetched blocks, sitting in host buffers, into the device's paged KV cache.

On CUDA the work runs on a side stream while compute proceeds on the compute stream::

    as blocks arrive         host slots --H2D, non_blocking--> device staging[i:j] (side)
    once the fetch is over   for each layer l: staging[:, l] -> pool blocks,
                             record event[l]                                       (side)
    compute, layer l         wait event[l], then attend over the cached prefix    (compute)

Host slots are pinned, so the H2D copies are true async DMA; they overlap the rest of the
fetch, and layer l's placement overlaps the compute of layers < l. Without CUDA the same code
path runs synchronously: layer l is copied from the host slots into the pool right before
layer l first needs it, one copy per layer for each run of blocks whose host slots lie evenly
spaced in one allocation and whose pool blocks are consecutive (:func:`slot_runs`): a copy per
block and layer cost more CPU in torch's per-call work than in moving the bytes (64 blocks of
30 layers: 1,920 calls per fetch, 0.06 CPU-s per GB on the 2-core machine).
"""

from __future__ import annotations

import time

import torch

from engine_adapter.kv_format import load_layer, load_layers
from engine_adapter.paged_kv import PagedKVCache


class SwapIn:
    """Moves ``len(host_blocks)`` fetched blocks into ``block_ids`` of ``cache``."""

    def __init__(
        self, cache: PagedKVCache, block_ids: list[int], host_blocks: list[torch.Tensor]
    ) -> None:
        self.cache = cache
        self.block_ids = block_ids  # pool blocks receiving the fetched blocks, in order
        self.host_blocks = host_blocks  # HostSlot.blocks: (layers, 2, heads, T, D), or bytes
        self.num_blocks = 0  # usable leading blocks, fixed by start()
        self._cuda = cache.kv.device.type == "cuda"
        self._loaded_layers: set[int] = set()
        self._runs: list[tuple[list[int], torch.Tensor]] | None = None  # CPU: slot_runs
        self._events: list[torch.cuda.Event] = []  # CUDA: layer l placed (timed)
        self._placing: torch.cuda.Event | None = None  # CUDA: the placement's start
        self._place_s = 0.0  # CPU: seconds the placing copies (and dequantise) took
        if self._cuda and host_blocks:
            self._stream = torch.cuda.Stream(device=cache.kv.device)
            shape = (len(host_blocks), *host_blocks[0].shape)  # [n, layers, 2, Hkv, T, D]
            dtype = host_blocks[0].dtype  # the cache's, or uint8 for e4m3x16 bytes
            with torch.cuda.stream(self._stream):  # staging memory belongs to the side stream
                self._staging = torch.empty(shape, dtype=dtype, device=cache.kv.device)

    def blocks_arrived(self, indexes: list[int]) -> None:
        """Blocks ``indexes`` are complete in their host slots: start their H2D copies (CUDA
        only), one per run of consecutive blocks whose slots lie back to back (slots are
        taken in address order, so one node's answer usually completes a few such runs): a
        copy per block cost 256 launches per fetch of a 16k prompt, on the event loop."""
        if not self._cuda or not indexes:
            return
        with torch.cuda.stream(self._stream):
            for run, stacked in slot_runs(indexes, [self.host_blocks[i] for i in indexes]):
                if stacked.is_contiguous():
                    self._staging[run[0] : run[-1] + 1].copy_(stacked, non_blocking=True)
                    continue
                for index in run:  # a strided source would be copied on the host first
                    self._staging[index].copy_(self.host_blocks[index], non_blocking=True)

    def start(self, num_blocks: int) -> None:
        """The first ``num_blocks`` blocks are usable: queue their placement layer by layer."""
        self.num_blocks = num_blocks
        if not self._cuda or not self.host_blocks:
            return
        if num_blocks == 0:  # nothing to place: let the issued copies finish with their slots
            self._stream.synchronize()
            return
        ids = self.block_ids[:num_blocks]
        with torch.cuda.stream(self._stream):
            self._placing = torch.cuda.Event(enable_timing=True)
            self._placing.record(self._stream)
            for layer in range(self.cache.layout.num_layers):
                load_layer(self.cache, layer, ids, self._staging[:num_blocks])
                event = torch.cuda.Event(enable_timing=True)
                event.record(self._stream)
                self._events.append(event)

    def before_layer(self, layer: int) -> None:
        """Compute is about to read layer ``layer`` of the cache: make sure it is there."""
        if self.num_blocks == 0:
            return
        if self._cuda:
            torch.cuda.current_stream(self.cache.kv.device).wait_event(self._events[layer])
        elif layer not in self._loaded_layers:
            started = time.perf_counter()
            self._load_on_cpu(layer)
            self._place_s += time.perf_counter() - started

    def _load_on_cpu(self, layer: int) -> None:
        if self._runs is None:
            ids, blocks = self.block_ids[: self.num_blocks], self.host_blocks[: self.num_blocks]
            self._runs = slot_runs(ids, blocks)
        if self.cache.layout.quantized:  # nothing to overlap on CPU: one batch of ops
            for ids, stacked in self._runs:
                load_layers(self.cache, 0, self.cache.layout.num_layers, ids, stacked)
            self._loaded_layers.update(range(self.cache.layout.num_layers))
            return
        for ids, stacked in self._runs:
            load_layer(self.cache, layer, ids, stacked)
        self._loaded_layers.add(layer)

    def place_s(self) -> float:
        """Seconds spent placing the blocks into the cache, layer by layer (the e4m3x16
        dequantise included). CPU: the copies compute waited for; CUDA: the copy stream's
        span from the first layer's placement to the last one's (it overlaps compute), once
        the compute that waited on it is done. 0 before :meth:`start` or with no blocks."""
        if self._placing is None:
            return self._place_s
        self._events[-1].synchronize()
        return self._placing.elapsed_time(self._events[-1]) / 1000.0


def slot_runs(
    block_ids: list[int], host_blocks: list[torch.Tensor]
) -> list[tuple[list[int], torch.Tensor]]:
    """The blocks as runs of (consecutive pool block ids, their host blocks stacked
    ``[n, *block.shape]``): a run's host blocks are views of one storage at a fixed distance
    from each other (slots of one pool, taken in order), stacked as a strided view of it with
    no copy, so one op per layer places the whole run."""
    runs: list[tuple[list[int], torch.Tensor]] = []
    start = 0
    for end in range(1, len(host_blocks) + 1):
        if end < len(host_blocks) and _continues(block_ids, host_blocks, start, end):
            continue
        first = host_blocks[start]
        step = (
            host_blocks[start + 1].storage_offset() - first.storage_offset()
            if end - start > 1
            else 0
        )
        stacked = first.as_strided((end - start, *first.shape), (step, *first.stride()))
        runs.append((block_ids[start:end], stacked))
        start = end
    return runs


def _continues(block_ids: list[int], blocks: list[torch.Tensor], start: int, end: int) -> bool:
    """Whether block ``end`` extends the run that begins at ``start`` (see :func:`slot_runs`)."""
    block, first = blocks[end], blocks[start]
    if (
        block_ids[end] != block_ids[end - 1] + 1
        or block.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    ):
        return False
    if block.shape != first.shape or block.stride() != first.stride() or block.dtype != first.dtype:
        return False
    step = blocks[start + 1].storage_offset() - first.storage_offset() if end - start > 1 else None
    distance = block.storage_offset() - blocks[end - 1].storage_offset()
    return distance > 0 and (step is None or distance == step)
