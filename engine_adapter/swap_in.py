"""Swap-in: fetched blocks, sitting in host buffers, into the device's paged KV cache.

On CUDA the work runs on a side stream while compute proceeds on the compute stream::

    as each block arrives    host slot --H2D, non_blocking--> device staging[i]   (side)
    once the fetch is over   for each layer l: staging[:, l] -> pool blocks,
                             record event[l]                                       (side)
    compute, layer l         wait event[l], then attend over the cached prefix    (compute)

Host slots are pinned, so the H2D copies are true async DMA; they overlap the rest of the
fetch, and layer l's placement overlaps the compute of layers < l. Without CUDA the same code
path runs synchronously: layer l is copied from the host slots into the pool right before
layer l first needs it.
"""

from __future__ import annotations

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
        self._events: list[torch.cuda.Event] = []
        if self._cuda and host_blocks:
            self._stream = torch.cuda.Stream(device=cache.kv.device)
            shape = (len(host_blocks), *host_blocks[0].shape)  # [n, layers, 2, Hkv, T, D]
            dtype = host_blocks[0].dtype  # the cache's, or uint8 for e4m3x16 bytes
            with torch.cuda.stream(self._stream):  # staging memory belongs to the side stream
                self._staging = torch.empty(shape, dtype=dtype, device=cache.kv.device)

    def block_arrived(self, index: int) -> None:
        """Block ``index`` is complete in its host slot: start its H2D copy (CUDA only)."""
        if self._cuda:
            with torch.cuda.stream(self._stream):
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
            for layer in range(self.cache.layout.num_layers):
                load_layer(self.cache, layer, ids, self._staging[:num_blocks])
                event = torch.cuda.Event()
                event.record(self._stream)
                self._events.append(event)

    def before_layer(self, layer: int) -> None:
        """Compute is about to read layer ``layer`` of the cache: make sure it is there."""
        if self.num_blocks == 0:
            return
        if self._cuda:
            torch.cuda.current_stream(self.cache.kv.device).wait_event(self._events[layer])
        elif layer not in self._loaded_layers:
            ids, blocks = self.block_ids[: self.num_blocks], self.host_blocks[: self.num_blocks]
            if self.cache.layout.quantized:  # nothing to overlap on CPU: one batch of ops
                load_layers(self.cache, 0, self.cache.layout.num_layers, ids, blocks)
                self._loaded_layers.update(range(self.cache.layout.num_layers))
                return
            load_layer(self.cache, layer, ids, blocks)
            self._loaded_layers.add(layer)
