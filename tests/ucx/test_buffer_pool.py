"""The client's buffer pool: slots are disjoint, aligned, reused, and handed to waiters."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from client.buffer_pool import PAGE_BYTES, BufferPool
from kvstore.errors import InvalidArgument


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_slots_are_disjoint_aligned_and_writable() -> None:
    pool = BufferPool(slot_bytes=10_000, num_slots=3)
    slots = [pool.try_acquire() for _ in range(3)]
    assert all(s is not None for s in slots)
    assert pool.try_acquire() is None, "an exhausted pool must answer None, not raise"
    for value, slot in enumerate(slots):
        assert len(slot.view) == 10_000
        assert _address(slot.view) % PAGE_BYTES == 0, "slots must start page aligned"
        slot.view[:] = bytes([value]) * 10_000
    for value, slot in enumerate(slots):
        assert slot.view == bytes([value]) * 10_000, "slots overlap: writes leaked across"


def test_release_makes_the_slot_available_again() -> None:
    pool = BufferPool(slot_bytes=64, num_slots=1)
    with pool.try_acquire() as slot:
        assert pool.num_free == 0
    assert pool.num_free == 1
    again = pool.try_acquire()
    assert again is slot, "the pool must reuse its one allocation, not allocate anew"


def test_double_release_and_foreign_slots_are_misuse() -> None:
    pool, other = BufferPool(64, 1), BufferPool(64, 1)
    slot = pool.try_acquire()
    slot.release()
    with pytest.raises(InvalidArgument, match="released twice"):
        slot.release()
    with pytest.raises(InvalidArgument, match="another pool"):
        other.release(slot)


@pytest.mark.parametrize(("slot_bytes", "num_slots"), [(0, 1), (1, 0), (-5, 2)])
def test_bad_sizes_are_rejected(slot_bytes: int, num_slots: int) -> None:
    with pytest.raises(InvalidArgument, match="slot_bytes > 0"):
        BufferPool(slot_bytes, num_slots)


def test_caller_supplied_memory_is_used_and_checked() -> None:
    backing = bytearray(3 * PAGE_BYTES)
    pool = BufferPool(PAGE_BYTES, 3, allocate=lambda n: backing)
    pool.try_acquire().view[:1] = b"x"
    assert backing[0:1] == b"x", "slots must be views of the memory allocate() returned"
    with pytest.raises(InvalidArgument, match="writable contiguous buffer"):
        BufferPool(PAGE_BYTES, 3, allocate=lambda n: bytes(n))
    with pytest.raises(InvalidArgument, match="at least"):
        BufferPool(PAGE_BYTES, 3, allocate=lambda n: bytearray(n - 1))


async def test_acquire_waits_for_a_release_and_times_out() -> None:
    pool = BufferPool(64, 1)
    slot = pool.try_acquire()
    waiter = asyncio.create_task(pool.acquire(timeout_s=5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    slot.release()
    handed = await waiter
    assert handed is slot, "a released slot must go to the waiting acquirer"
    with pytest.raises(TimeoutError):
        await pool.acquire(timeout_s=0.01)
    handed.release()
    assert pool.num_free == 1, "a timed-out acquire must not keep a slot"


def test_slot_offset_locates_the_slot_in_the_supplied_memory() -> None:
    slot_bytes = PAGE_BYTES + 1  # strides round up to two pages
    backing = bytearray(3 * 2 * PAGE_BYTES)
    pool = BufferPool(slot_bytes, 3, allocate=lambda n: backing)
    slots = [pool.try_acquire() for _ in range(3)]
    assert [s.offset for s in slots] == [0, 2 * PAGE_BYTES, 4 * PAGE_BYTES]
    slots[2].view[:] = b"z" * slot_bytes
    start = slots[2].offset
    assert backing[start : start + slot_bytes] == b"z" * slot_bytes, "offset is not the view's"
