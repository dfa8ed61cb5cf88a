"""Host memory for KV blocks in transit: one long-lived allocation, one block per slot.

::

    one torch allocation (pinned when the engine runs on CUDA)
    +---------+---------+-----+-------------------+
    | slot 0  | slot 1  | ... | slot num_slots-1  |      each slot = one serialised KV block
    +---------+---------+-----+-------------------+

Allocating once and reusing slots avoids per-request allocation (and glibc's costs for large
buffers, DESIGN.md section 6); pinned slots make host<->device copies asynchronous DMA. The
CPU build of torch has no pinned memory, so plain memory is used there. Each slot is seen
two ways: ``slot.view`` (a writable memoryview for ``get_into``/``put``) and ``slot.block``
(the same bytes as a ``kv_layout``-shaped tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_adapter.kv_layout import KVBlockLayout


@dataclass
class HostSlot:
    pool: HostBlockPool
    index: int
    view: memoryview  # writable, exactly one block
    block: torch.Tensor  # the same memory, shape layout.shape, dtype layout.dtype
    released: bool = False

    def release(self) -> None:
        """Give the slot back; no transfer may still be using its bytes."""
        self.pool.release(self)


class HostBlockPool:
    """``num_slots`` host buffers of one serialised KV block each."""

    def __init__(self, layout: KVBlockLayout, num_slots: int, pin_memory: bool) -> None:
        self.layout = layout
        # [num_slots, block_bytes]
        self._memory = torch.empty(
            num_slots, layout.block_bytes, dtype=torch.uint8, pin_memory=pin_memory
        )
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, num_slots: int) -> list[HostSlot]:
        """Up to ``num_slots`` free slots (fewer when others are in use)."""
        slots = []
        while len(slots) < num_slots and self._free:
            slots.append(self._slot(self._free.pop()))
        return slots

    def release(self, slot: HostSlot) -> None:
        assert slot.pool is self and not slot.released, "slot released twice"
        slot.released = True
        self._free.append(slot.index)

    def _slot(self, index: int) -> HostSlot:
        raw = self._memory[index]  # [block_bytes] uint8
        block = raw.view(getattr(torch, self.layout.dtype)).view(self.layout.shape)
        return HostSlot(self, index, memoryview(raw.numpy()), block)
