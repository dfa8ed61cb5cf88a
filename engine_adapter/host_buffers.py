"""Host memory for KV blocks in transit: the client's buffer pool, one KV block per slot.

This is the one place that explains how the engine's swap-in buffers relate to the client's
buffer pool. ``HostBlockPool`` is a ``client.buffer_pool.BufferPool`` (the pool ``get_into``
fills, slots carved from one long-lived allocation, page-aligned stride) whose memory the
engine supplies through its ``allocate`` hook: a torch uint8 tensor, pinned when the engine
runs on CUDA::

    one torch uint8 tensor (pinned on CUDA), page aligned, handed to BufferPool(allocate=)
    +----------------+----------------+-----+------------------+
    | slot 0         | slot 1         | ... | slot num_slots-1 |   each slot = one KV block
    +----------------+----------------+-----+------------------+
    |<- block_bytes ->|  (stride = block_bytes rounded up to a page; slot i at slot.offset)

Each ``HostSlot`` sees its slot two ways: ``view`` (the BufferSlot's writable memoryview,
exactly one block, what ``get_into`` and ``put`` take) and ``block`` (a torch tensor over the
same bytes, shaped and typed by ``kv_layout``, what the swap-in copies to the device). One
allocation reused for every request avoids per-request allocation (and glibc's costs for large
buffers, DESIGN.md section 6) and is what the client registers once for UCX; pinned slots
make host-to-device copies asynchronous DMA. The CPU build of torch has no pinned memory, so
plain memory is used there.
"""

from __future__ import annotations

import torch

from client.buffer_pool import PAGE_BYTES, BufferPool, BufferSlot
from engine_adapter.kv_layout import KVBlockLayout
from kvstore.errors import InvalidArgument


class HostSlot:
    """One KV block's slot of a :class:`HostBlockPool`; ``release()`` it when done."""

    def __init__(self, slot: BufferSlot, block: torch.Tensor) -> None:
        self.slot = slot
        self.block = block  # the same bytes as view, shape layout.shape, dtype layout.dtype
        self.released = False

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def view(self) -> memoryview:
        """Writable, exactly one block."""
        return self.slot.view

    def release(self) -> None:
        """Give the slot back; no transfer may still be using its bytes."""
        # BufferPool hands out the same BufferSlot again once it is free, so only this handle
        # can tell a stale second release from the new holder's.
        if self.released:
            raise InvalidArgument(f"host slot {self.index} released twice")
        self.released = True
        self.slot.release()


class HostBlockPool:
    """``num_slots`` host buffers of one serialised KV block each (see the module doc)."""

    def __init__(self, layout: KVBlockLayout, num_slots: int, pin_memory: bool) -> None:
        self.layout = layout
        self._pin_memory = pin_memory
        self._memory: torch.Tensor  # set by _allocate, which BufferPool calls once, below
        self.buffers = BufferPool(layout.block_bytes, num_slots, allocate=self._allocate)

    @property
    def num_free(self) -> int:
        return self.buffers.num_free

    def acquire(self, num_slots: int) -> list[HostSlot]:
        """Up to ``num_slots`` free slots (fewer when others are in use)."""
        slots = []
        while len(slots) < num_slots and (slot := self.buffers.try_acquire()) is not None:
            slots.append(HostSlot(slot, self._block(slot)))
        return slots

    def _allocate(self, num_bytes: int) -> memoryview:
        self._memory = host_tensor(num_bytes, self._pin_memory)
        return memoryview(self._memory.numpy())

    def _block(self, slot: BufferSlot) -> torch.Tensor:
        raw = self._memory[slot.offset : slot.offset + self.layout.block_bytes]
        return raw.view(getattr(torch, self.layout.dtype)).view(self.layout.shape)


def host_tensor(num_bytes: int, pin_memory: bool) -> torch.Tensor:
    """A page-aligned uint8 host tensor of ``num_bytes`` (pinned when asked): the memory
    BufferPools of KV blocks are carved from (``BufferPool(allocate=host_memory)``)."""
    # torch aligns host tensors to 64 bytes only; a page more lets every slot start on a
    # page, as BufferPool's own memory does.
    raw = torch.empty(num_bytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + num_bytes]


def host_memory(num_bytes: int, pin_memory: bool = False) -> memoryview:
    """:func:`host_tensor` as the writable memoryview a BufferPool's ``allocate`` returns."""
    return memoryview(host_tensor(num_bytes, pin_memory).numpy())
