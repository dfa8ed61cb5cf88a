"""glibc's allocator and multi-megabyte buffers: keep freed memory for the next block.

By default glibc serves large allocations with fresh ``mmap`` calls and hands freed heap
memory back to the kernel as soon as more than twice its (dynamic) mmap threshold is free at
the top of the heap. A codec that returns k+m new shards per block, or a new block per decode,
hits both on every call, so every call touches fresh pages, and a page fault costs more than
ISA-L needs to encode the page.

With the defaults an encode page-faults on every shard buffer it returns and runs several
times slower; with the thresholds raised it faults no more (docs/design-measurements.md has the
figures, page faults included).

The codec reuses per-thread scratch buffers and a decode allocates one block (nothing with
``out=``), which glibc's dynamic threshold handles; but the k+m shards an encode returns must be
new ``bytes`` (protobuf accepts nothing else), so a process that encodes many blocks should call
this once at start-up. The environment can do the same before start-up:
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MiB = 1 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
# glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2, which is 32 MiB on 64-bit systems.
DEFAULT_MMAP_THRESHOLD_BYTES = 32 * MiB
DEFAULT_TRIM_THRESHOLD_BYTES = 1024 * MiB


def tune_glibc_malloc(
    mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = DEFAULT_TRIM_THRESHOLD_BYTES,
) -> bool:
    """Serve buffers below ``mmap_threshold_bytes`` from the heap and keep up to
    ``trim_threshold_bytes`` of freed heap for reuse. Process-wide; call once at start-up.

    Returns False (and changes nothing) where the C library is not glibc.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "gnu_get_libc_version"):
        log.info("not glibc: malloc left as it is")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1 and ok
    log.info(
        "glibc malloc: mmap threshold %d B, trim threshold %d B, accepted: %s",
        mmap_threshold_bytes,
        trim_threshold_bytes,
        ok,
    )
    return ok
