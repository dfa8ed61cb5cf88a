"""A pool of fixed-size buffer slots carved from one long-lived allocation.

Shards read over UCX land straight in these slots, and ``get_into`` fills them; the engine's
swap-in buffers come from the same pool. One allocation made once matters for two reasons:
UCX registers memory for a transfer and caches the registration (on RDMA hardware that pins
pages; over shared memory the client reads with a CMA get and needs none), so a pool that
lives as long as the client is registered once instead of on every read; and reusing
buffers avoids glibc's allocator costs for large blocks (DESIGN.md section 6).

::

    one allocation of num_slots * slot_stride bytes (page aligned)
    +----------------+----------------+-----+------------------+
    | slot 0         | slot 1         | ... | slot num_slots-1 |
    +----------------+----------------+-----+------------------+
    |<- slot_bytes ->|   (slot_stride = slot_bytes + slack_bytes rounded up to
                          alignment_bytes)

The pool is torch-free: the engine supplies the memory through ``allocate`` (a torch tensor,
pinned when CUDA is present) and views each slot as a KV block tensor too, at ``slot.offset``
(engine_adapter/host_buffers.py).
"""

from __future__ import annotations

import asyncio
import mmap
from collections import deque
from collections.abc import Callable
from typing import Any

from kvstore.errors import InvalidArgument

PAGE_BYTES = mmap.PAGESIZE


class BufferSlot:
    """One slot of a :class:`BufferPool`; release it (or leave its ``with`` block) when done."""

    def __init__(self, pool: BufferPool, index: int, view: memoryview) -> None:
        self.pool = pool
        self.index = index
        self.view = view  # slot_bytes long, writable

    @property
    def offset(self) -> int:
        """Where ``view`` starts in the pool's memory, in bytes: lets the owner of that memory
        see the slot another way (the engine views it as a torch tensor)."""
        return self.index * self.pool.slot_stride

    def release(self) -> None:
        """Give the slot back; its bytes must no longer be in use (no transfer pending)."""
        self.pool.release(self)

    def __enter__(self) -> BufferSlot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class BufferPool:
    """``num_slots`` writable slots of ``slot_bytes`` each, handed out and taken back."""

    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        *,
        alignment_bytes: int = PAGE_BYTES,
        allocate: Callable[[int], Any] | None = None,
        slack_bytes: int = 0,
    ) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise InvalidArgument(
                f"buffer pool needs slot_bytes > 0 and num_slots > 0, got {slot_bytes} and "
                f"{num_slots}"
            )
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise InvalidArgument(f"alignment_bytes must be a power of two, got {alignment_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.slot_stride = -(-(slot_bytes + slack_bytes) // alignment_bytes) * alignment_bytes
        self._memory = _allocate(self.slot_stride * num_slots, allocate)
        self._slots = [self._make_slot(i) for i in range(num_slots)]
        self._free = list(reversed(self._slots))  # pop() hands out slot 0 first
        self._in_use: set[int] = set()
        self._waiters: deque[asyncio.Future[BufferSlot]] = deque()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def try_acquire(self) -> BufferSlot | None:
        """A free slot, or None when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._in_use.add(slot.index)
        return slot

    async def acquire(self, timeout_s: float | None = None) -> BufferSlot:
        """A free slot, waiting up to ``timeout_s`` for one (TimeoutError after that)."""
        slot = self.try_acquire()
        if slot is not None:
            return slot
        waiter: asyncio.Future[BufferSlot] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())  # handed over just as we timed out
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self, slot: BufferSlot) -> None:
        """Take ``slot`` back; releasing a slot twice or from another pool is misuse."""
        if slot.pool is not self or slot.index not in self._in_use:
            raise InvalidArgument(
                f"slot {slot.index} is not in use in this pool: released twice, or from "
                "another pool"
            )
        while self._waiters:  # hand the slot straight to the longest waiter
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._in_use.discard(slot.index)
        self._free.append(slot)

    def _make_slot(self, index: int) -> BufferSlot:
        start = index * self.slot_stride
        return BufferSlot(self, index, self._memory[start : start + self.slot_bytes])


def _allocate(num_bytes: int, allocate: Callable[[int], Any] | None) -> memoryview:
    memory = mmap.mmap(-1, num_bytes) if allocate is None else allocate(num_bytes)
    view = memoryview(memory).cast("B")
    if view.readonly or not view.contiguous or len(view) < num_bytes:
        raise InvalidArgument(
            f"allocate({num_bytes}) must return a writable contiguous buffer of at least "
            f"{num_bytes} bytes; got {len(view)} bytes (readonly={view.readonly})"
        )
    return view[:num_bytes]
