"""The landing pool: buffer slots in memory that the client's local nodes write into directly.

A :class:`LandingPool` is a :class:`~client.buffer_pool.BufferPool` whose one allocation is a
sealed memfd (kvstore/byte_arena.py ``shared_memory``). A client given the pool
(``KVClient.connect(..., landing_pool=pool)``) hands its memfd to every node it links to on
this host (client/local/link.py), and a batch read into buffers that lie in the pool names,
per block, its place there: each node ``preadv``s its data shard straight to where the shard
belongs in the block (kvstore/wire/landing.py), so the client copies nothing::

    one sealed memfd: mapped here (and registered with CUDA by the engine), and by each node
    +----------------+----------------+-----+
    | slot 0         | slot 1         | ... |   slot = one block, then slack: the last data
    +----------------+----------------+-----+   shard's zero padding (< k bytes) lands there
    |<- slot_bytes ->|<- slack ->|              stride: slot_bytes + SLACK_BYTES, page aligned

Buffers elsewhere still work: their shards land in the link's arena and are copied into place.

Late writes. A node writes into a slot only under its request's permit, and the client revokes
the permits of requests it gives up (hedging, deadlines), so nothing lands after a read
returned. The one exception is a node caught in the middle of writing when the client gives up
(a process stopped between two ``preadv``): then the slots of that request are *held*: the read
reports those blocks as misses, and the slots are not handed out again until the write is
known to be over (the request's permit reached DONE, or the node's process is gone). Nothing a
caller reads from a slot can change under it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable

from client.buffer_pool import BufferPool, BufferSlot
from kvstore.byte_arena import shared_memory
from kvstore.errors import InvalidArgument

SLACK_BYTES = 256  # > k - 1 bytes of zero padding in the last data shard (k < 256)


class LandingPool(BufferPool):
    """``num_slots`` slots of ``slot_bytes`` (one block each) in shared memory (module doc)."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        self._mapping = None
        self.fd = -1

        def allocate(num_bytes: int) -> object:
            # Every page now: nodes' first writes then take no page faults on the read path.
            self.fd, self._mapping = shared_memory(num_bytes, "kvstore-landing", populate=True)
            return self._mapping

        super().__init__(slot_bytes, num_slots, allocate=allocate, slack_bytes=SLACK_BYTES)
        self.memory = self._memory  # the whole pool, writable
        self.num_bytes = len(self.memory)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self._held: dict[int, Callable[[], bool]] = {}  # slot index -> over when true
        self._held_free: set[int] = set()  # held slots their holder released

    def locate(self, view: memoryview) -> int | None:
        """Where ``view`` starts in the pool, if it lies inside one slot; else None."""
        if not len(view):
            return None
        start = ctypes.addressof(ctypes.c_char.from_buffer(view)) - self.address
        if not 0 <= start < self.num_bytes:
            return None
        slot_end = (start // self.slot_stride + 1) * self.slot_stride
        return start if start + len(view) <= slot_end else None

    def capacity_at(self, offset: int) -> int:
        """Bytes from ``offset`` to the end of its slot (the slack included)."""
        return (offset // self.slot_stride + 1) * self.slot_stride - offset

    def hold(self, offsets: Iterable[int], until: Callable[[], bool]) -> None:
        """A write into the slots at ``offsets`` may still be under way: report them tainted
        and keep them from being handed out again until ``until()`` is true."""
        for offset in offsets:
            self._held[offset // self.slot_stride] = until

    def is_tainted(self, offset: int) -> bool:
        """Whether the slot at ``offset`` may still be written by a late node."""
        index = offset // self.slot_stride
        until = self._held.get(index)
        if until is None:
            return False
        if until():
            del self._held[index]
            return False
        return True

    def try_acquire(self) -> BufferSlot | None:
        self._reclaim()
        return super().try_acquire()

    def release(self, slot: BufferSlot) -> None:
        """Take ``slot`` back; a held slot waits until its late write is over (module doc)."""
        if slot.pool is self and self.is_tainted(slot.index * self.slot_stride):
            if slot.index not in self._in_use:
                raise InvalidArgument(f"slot {slot.index} released twice")
            self._in_use.discard(slot.index)
            self._held_free.add(slot.index)
            return
        super().release(slot)

    @property
    def num_held(self) -> int:
        """Slots kept out of use for a write that may still be under way."""
        return len(self._held)

    def _reclaim(self) -> None:
        for index in list(self._held_free):
            if not self.is_tainted(index * self.slot_stride):
                self._held_free.discard(index)
                self._in_use.add(index)
                super().release(self._slots[index])

    def close(self) -> None:
        """Close the memfd (nodes keep their own mappings until their links end)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
