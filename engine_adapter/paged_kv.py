"""Paged KV cache: a pool of fixed-size blocks on the device and per-sequence block tables.

The block is the store's block: ``block_tokens`` tokens of every layer's KV cache. The pool
keeps each layer's parts (K and V, or MLA's one latent) in an attention-friendly layout so
that a sequence whose blocks are consecutive (the common case: the pool hands out the lowest
free ids) is read without a gather::

    kv[layer, part (K | V, or the latent), kv_head, block_id * block_tokens + offset, head_dim]

Block ``b`` of layer ``l`` is ``kv[l, :, :, b*T:(b+1)*T, :]``, shape
``[num_parts, num_kv_heads, block_tokens, head_dim]``: exactly one layer of one store block
(see ``kv_layout``), so swapping a block in or out is a strided copy per layer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_adapter.kv_layout import KVBlockLayout
from kvstore.errors import CapacityExhausted


class BlockPool:
    """Free-list of block ids. Hands out the lowest free ids so tables stay consecutive."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free_ids = list(range(num_blocks))  # kept sorted

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free ids; raises ``CapacityExhausted`` if the pool is short."""
        if num_blocks > len(self._free_ids):
            raise CapacityExhausted(
                f"KV block pool has {len(self._free_ids)} free blocks, {num_blocks} needed; "
                "release finished sequences or raise EngineConfig.max_num_seqs/max_model_len"
            )
        taken, self._free_ids = self._free_ids[:num_blocks], self._free_ids[num_blocks:]
        return taken

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert 0 <= block_id < self.num_blocks, f"block id {block_id} is not from this pool"
            bisect.insort(self._free_ids, block_id)
        assert len(set(self._free_ids)) == len(self._free_ids), "a block was freed twice"


@dataclass
class BlockTable:
    """The blocks holding one sequence's KV, in token order."""

    block_tokens: int
    block_ids: list[int] = field(default_factory=list)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def slots(self, start: int, end: int) -> list[int]:
        """Pool slot (``block_id * block_tokens + offset``) of each position in [start, end)."""
        t = self.block_tokens
        return [self.block_ids[p // t] * t + p % t for p in range(start, end)]

    def first_consecutive(self, num_blocks: int) -> int | None:
        """First block id if the first ``num_blocks`` ids are consecutive, else None."""
        return _first_if_consecutive(self.block_ids[:num_blocks])


def _first_if_consecutive(block_ids: list[int]) -> int | None:
    if block_ids and block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))):
        return block_ids[0]
    return None


class PagedKVCache:
    """The device-side KV pool of all layers (see the module doc for its layout)."""

    def __init__(self, layout: KVBlockLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.pool = BlockPool(num_blocks)
        layers, parts, heads, tokens, dim = layout.shape
        dtype = getattr(torch, layout.dtype)
        # [layers, parts, kv_heads, num_blocks * block_tokens, head_dim]
        self.kv = torch.empty(
            layers, parts, heads, num_blocks * tokens, dim, dtype=dtype, device=device
        )

    def slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions [start, end) as a device tensor (for ``write``)."""
        first = table.first_consecutive(table.num_blocks_for(end))
        if first is not None:  # no Python list of every position (16k of them per prefill)
            offset = first * self.layout.block_tokens
            return torch.arange(offset + start, offset + end, device=self.kv.device)
        return torch.tensor(table.slots(start, end), device=self.kv.device)

    def write(self, layer: int, slots: torch.Tensor, *parts: torch.Tensor) -> None:
        """Store the parts (K and V, or MLA's latent), each ``[n, kv_heads, head_dim]``, at
        pool ``slots`` ``[n]``."""
        assert len(parts) == self.layout.num_parts, f"{len(parts)} parts for {self.layout}"
        for index, part in enumerate(parts):  # [kv_heads, n, head_dim] into the pool
            self.kv[layer, index].index_copy_(1, slots, part.transpose(0, 1))

    def read(self, layer: int, table: BlockTable, num_tokens: int) -> torch.Tensor:
        """The parts of positions [0, num_tokens): ``[parts, kv_heads, num_tokens, head_dim]``."""
        t = self.layout.block_tokens
        first = table.first_consecutive(table.num_blocks_for(num_tokens))
        if first is not None:
            return self.kv[layer, :, :, first * t : first * t + num_tokens]  # a view, no copy
        slots = torch.tensor(table.slots(0, num_tokens), device=self.kv.device)
        return self.kv[layer].index_select(2, slots)

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        """One layer of one block, ``[parts, kv_heads, block_tokens, head_dim]`` (a view)."""
        t = self.layout.block_tokens
        return self.kv[layer, :, :, block_id * t : (block_id + 1) * t]

    def load_layer(
        self, layer: int, block_ids: list[int], blocks: list[torch.Tensor] | torch.Tensor
    ) -> None:
        """Copy layer ``layer`` of serialised blocks (each ``kv_layout`` shaped) into the pool.

        ``blocks`` stacked in one tensor and consecutive ``block_ids`` take one copy.
        """
        first = _first_if_consecutive(block_ids)
        if isinstance(blocks, torch.Tensor) and first is not None:
            n, (_, p, h, t, d) = len(block_ids), self.layout.shape
            dest = self.kv[layer, :, :, first * t : (first + n) * t]  # [P, Hkv, n*T, D]
            source = blocks[:, layer].permute(
                1, 2, 0, 3, 4
            )  # [n, P, Hkv, T, D] -> [P, Hkv, n, T, D]
            _copy(dest.view(p, h, n, t, d), source)
            return
        for block_id, block in zip(block_ids, blocks, strict=True):
            self.block(layer, block_id).copy_(block[layer], non_blocking=True)

    def save_block(self, block_id: int, out: torch.Tensor) -> None:
        """Serialise all layers of one block into ``out`` (``kv_layout`` shape)."""
        for layer in range(self.layout.num_layers):
            out[layer].copy_(self.block(layer, block_id), non_blocking=True)


def _copy(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)``; between host tensors through numpy, as bytes: torch ran this
    strided copy (a run of blocks' layer, ``[P, Hkv, n, T, D]``) over its intra-op threads at
    4x the CPU time of a one-thread numpy copy on the 2-core machine (0.46 vs 0.10 CPU-s per
    GB), and numpy has no bfloat16 (the bytes are the same)."""
    if dest.device.type == "cpu" and source.device.type == "cpu" and dest.dtype == source.dtype:
        np.copyto(dest.view(torch.uint8).numpy(), source.view(torch.uint8).numpy())
        return
    dest.copy_(source, non_blocking=True)
