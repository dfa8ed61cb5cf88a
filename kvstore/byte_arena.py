"""One long-lived allocation carved into variable-size regions: staging that is never re-faulted.

A node gathers a batch's shard payloads into one region (``preadv`` straight into it) and
sends it whole; a client lands the payloads that have no place in the caller's blocks
(parity, a zero-padded last shard) in regions too. Fresh multi-megabyte buffers cost a page
fault per 4 KiB on every use (DESIGN.md section 6: about 3 us each in this VM, more than the
copy); an arena's pages stay mapped, and UCX registers its memory once (its registration
cache keeps the mapping), so transfers into it pay neither again.

::

    one mmap of capacity_bytes, regions rounded up to ALIGN_BYTES
    +--------+----------+------+--------------------+---------+
    | region | (free)   | reg. | region             | (free)  |
    +--------+----------+------+--------------------+---------+

First fit over a free list kept sorted by offset, neighbours merged on release. When no
free run is long enough, :meth:`ByteArena.take` hands out a plain ``bytearray`` instead (and
counts it), so a burst larger than the arena still works, only slower; :meth:`ByteArena.
try_take` answers None instead. Thread-safe: a node takes regions in its executor and gives
them back on its event loop.

``ByteArena(..., shared=True)`` puts the memory in a memfd that another process on the host
may map (``fd``): a local-read client's arena, which the node ``preadv``s payloads into
(kvstore/wire/local_frames.py). The memfd is sealed against shrinking and growing, so the mapping
of whoever received it can never lose pages (SIGBUS) under it; a fresh memfd is zero-filled,
so it only ever holds what its owner was sent.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import threading

from kvstore.errors import InvalidArgument

ALIGN_BYTES = 4096
SHARED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Region:
    """A writable span of an arena (or a fallback buffer); ``release()`` it when done."""

    def __init__(
        self, arena: ByteArena | None, offset: int, view: memoryview, span_bytes: int = 0
    ) -> None:
        self._arena = arena
        self.offset = offset
        self.view = view  # exactly the bytes asked for
        self._span_bytes = span_bytes  # what the arena set aside (rounded up, at least 1)
        self._released = False

    def release(self) -> None:
        """Give the span back; nothing may still read or write it (no transfer in flight)."""
        if self._released:
            return
        self._released = True
        if self._arena is not None:
            self._arena._free(self.offset, self._span_bytes)


class ByteArena:
    """``capacity_bytes`` of reusable memory handed out as :class:`Region` objects."""

    def __init__(self, capacity_bytes: int, *, shared: bool = False) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"arena capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = _rounded(capacity_bytes)
        self.fd = -1  # the memfd of a shared arena (see the module doc)
        if shared:
            self.fd, mapping = shared_memory(self.capacity_bytes, "kvstore-arena")
        else:
            mapping = mmap.mmap(-1, self.capacity_bytes)
        self._memory = memoryview(mapping)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        self._lock = threading.Lock()
        self._free_starts = [0]  # sorted offsets of free runs
        self._free_lengths = [self.capacity_bytes]
        self.num_fallbacks = 0  # takes served by a fresh bytearray (the arena was full)

    def take(self, num_bytes: int) -> Region:
        """A region of exactly ``num_bytes`` (contents undefined)."""
        region = self.try_take(num_bytes)
        if region is not None:
            return region
        with self._lock:
            self.num_fallbacks += 1
        return Region(None, 0, memoryview(bytearray(num_bytes)))

    def try_take(self, num_bytes: int) -> Region | None:
        """A region of the arena of exactly ``num_bytes``, or None when no free run fits."""
        if num_bytes < 0:
            raise InvalidArgument(f"cannot take {num_bytes} bytes")
        needed = _rounded(max(num_bytes, 1))
        with self._lock:
            for i, length in enumerate(self._free_lengths):
                if length >= needed:
                    start = self._free_starts[i]
                    if length == needed:
                        del self._free_starts[i], self._free_lengths[i]
                    else:
                        self._free_starts[i] += needed
                        self._free_lengths[i] -= needed
                    return Region(self, start, self._memory[start : start + num_bytes], needed)
        return None

    def close(self) -> None:
        """Close a shared arena's memfd (the mapping lives on while regions are in use)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def num_free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_lengths)

    def _free(self, start: int, length: int) -> None:
        with self._lock:
            i = bisect.bisect(self._free_starts, start)
            self._free_starts.insert(i, start)
            self._free_lengths.insert(i, length)
            if i + 1 < len(self._free_starts) and start + length == self._free_starts[i + 1]:
                self._free_lengths[i] += self._free_lengths.pop(i + 1)
                del self._free_starts[i + 1]
            if i and self._free_starts[i - 1] + self._free_lengths[i - 1] == start:
                self._free_lengths[i - 1] += self._free_lengths.pop(i)
                del self._free_starts[i]


def shared_memory(num_bytes: int, name: str, *, populate: bool = False) -> tuple[int, mmap.mmap]:
    """A fresh zero-filled memfd of ``num_bytes``, sealed against shrinking and growing so
    whoever maps it can never lose pages under it, and its read-write mapping here.
    ``populate``: allocate and map every page now, not at each page's first touch."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARED_SEALS)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return fd, mmap.mmap(fd, num_bytes, flags=flags)
    except BaseException:
        os.close(fd)
        raise


def _rounded(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES
