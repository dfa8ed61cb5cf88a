"""Host memory for KV blocks in transit: the client's buffer pool, one KV block per slot.

This is the one place that explains how the engine's swap-in buffers relate to the client's
buffer pools. ``HostBlockPool`` is a ``client.buffer_pool.BufferPool`` (slots carved from one
long-lived allocation, page-aligned stride) seen as torch tensors:

- the fetch pool (``shared=True``) is a ``client.landing_pool.LandingPool``: a sealed memfd
  that the client hands to the store's nodes on this host, so each node writes its data
  shards straight to their final place in the slot (nobody copies a fetched byte), and that
  the engine registers with CUDA once (``cudaHostRegister``), so the host-to-device copies
  are DMA from exactly the bytes the nodes wrote;
- the write-back pool is a torch uint8 tensor, pinned on CUDA::

    one allocation (a registered memfd, or a pinned torch tensor), page aligned
    +----------------+----------------+-----+------------------+
    | slot 0         | slot 1         | ... | slot num_slots-1 |   each slot = one KV block
    +----------------+----------------+-----+------------------+
    |<- block_bytes ->|  (stride = block_bytes (+ slack) rounded up to a page; slot.offset)

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
from client.landing_pool import LandingPool
from engine_adapter.kv_layout import KVBlockLayout
from kvstore.errors import InvalidArgument


class HostSlot:
    """One KV block's slot of a :class:`HostBlockPool`; ``release()`` it when done."""

    def __init__(self, slot: BufferSlot, block: torch.Tensor) -> None:
        self.slot = slot
        # the same bytes as view: shape layout.shape, dtype layout.dtype; or for e4m3x16
        # uint8 [num_layers, layer_bytes]
        self.block = block
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

    def __init__(
        self, layout: KVBlockLayout, num_slots: int, pin_memory: bool, *, shared: bool = False
    ) -> None:
        self.layout = layout
        self._pin_memory = pin_memory
        self._memory: torch.Tensor  # set by _allocate, which BufferPool calls once, below
        self._views: dict[int, torch.Tensor] = {}  # slot offset -> its block's view
        self._registered = 0  # address cudaHostRegister pinned (0: none)
        self.landing_pool: LandingPool | None = None
        if shared:
            self.landing_pool = LandingPool(layout.block_bytes, num_slots)
            self.buffers: BufferPool = self.landing_pool
            self._memory = torch.frombuffer(self.landing_pool.memory, dtype=torch.uint8)
            if pin_memory:
                self._register(self.landing_pool.address, self.landing_pool.num_bytes)
        else:
            self.buffers = BufferPool(layout.block_bytes, num_slots, allocate=self._allocate)

    def _register(self, address: int, num_bytes: int) -> None:
        register_for_dma(address, num_bytes)
        self._registered = address

    def close(self) -> None:
        """Unpin the pool and close its memfd (no transfer may still use it)."""
        if self._registered:
            unregister_for_dma(self._registered)
            self._registered = 0
        if self.landing_pool is not None:
            self.landing_pool.close()

    @property
    def num_free(self) -> int:
        return self.buffers.num_free

    def acquire(self, num_slots: int) -> list[HostSlot]:
        """Up to ``num_slots`` free slots (fewer when others are in use), in address order:
        slots freed together come back as one evenly spaced run, which the CPU swap-in
        places with one copy per layer (engine_adapter/swap_in.py ``slot_runs``)."""
        taken = []
        while len(taken) < num_slots and (slot := self.buffers.try_acquire()) is not None:
            taken.append(slot)
        taken.sort(key=lambda slot: slot.offset)
        return [HostSlot(slot, self._block(slot)) for slot in taken]

    def _allocate(self, num_bytes: int) -> memoryview:
        self._memory = host_tensor(num_bytes, self._pin_memory)
        return memoryview(self._memory.numpy())

    def _block(self, slot: BufferSlot) -> torch.Tensor:
        """The slot's block as a tensor view, made once per slot: a fetch of 256 blocks made
        512 views anew before its first request (``acquire`` took 81 ms over 20 fetches under
        cProfile in stop 51's GPU profile of misses, docs/runs/stop51-gpu/miss_probe_256.txt)."""
        view = self._views.get(slot.offset)
        if view is None:
            view = self._views[slot.offset] = self._view(slot.offset)
        return view

    def _view(self, offset: int) -> torch.Tensor:
        raw = self._memory[offset : offset + self.layout.block_bytes]
        if self.layout.quantized:  # e4m3x16 bytes, one row per layer (kv_format.py)
            return raw.view(self.layout.num_layers, self.layout.layer_bytes)
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


def register_for_dma(address: int, num_bytes: int) -> None:
    """Pin memory torch did not allocate (a landing pool's memfd) for the GPU's DMA engines,
    as pin_memory does for torch's own allocations: once, for the memory's lifetime."""
    error = torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)
    if int(error) != 0:
        raise InvalidArgument(f"cudaHostRegister of the landing pool failed: error {error}")


def unregister_for_dma(address: int) -> None:
    """Undo :func:`register_for_dma` (no transfer may still use the memory)."""
    torch.cuda.cudart().cudaHostUnregister(address)
