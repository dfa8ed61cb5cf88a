"""Landing in place: where a local client wants a node to put payloads, and the native loop.

A client on a node's host may share one more memory region with its nodes beside its arena:
its *landing pool* (client/landing_pool.py), the memory the engine copies to the GPU from.
A local READ then names, per key, a place in that pool (:class:`Place`), and the node
``preadv``s the data shard's payload straight there: nobody copies it again. What is shared
and why it is safe::

    pool   [ slot 0 | slot 1 | ... ]     block j of a read lands in its slot: data shard i
            |<- i*P ->|<- P ->|           of the block at slot + i*P, P payload bytes
    permit words (the client's arena)    one per READ that names places: the node moves its
                                          word ARMED -> WRITING before its first write into
                                          the pool, and -> DONE after its last; the client
                                          revokes a request it gave up on ARMED -> REVOKED.
                                          One compare-and-swap wins, so no node writes into
                                          a slot after the client revoked its request.

A node places a payload only where the request said: the key's shard index and payload length
must be the ones the client expects (so the write covers exactly that shard's range of the
block), and the range must lie inside the place's ``capacity_bytes`` and the pool.

:func:`read_records` is the node's batch read loop in one native call without the GIL, a
large request's records spread over a few threads (kvstore/wire/landing.c, built by ``make
native``); ``NATIVE`` says whether it is there.
Without it (or with ``KVSTORE_NATIVE=0``) nodes read through Python and refuse places (the
client's arena carries every payload, as before), and clients do not name places.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LIBRARY_PATH = Path(__file__).with_name("_landing.so")

# Permit states (the low 2 bits of a permit word; the rest is its generation).
REVOKED, ARMED, WRITING, DONE = 0, 1, 2, 3
STATE_MASK = 3
PERMIT_BYTES = 4

# A request's records are read by up to this many threads, one per RECORDS_PER_THREAD: a
# node answers a large request sooner (its work is the same), while the host's cores are
# shared by the client and every node of it.
READ_THREADS = 4
RECORDS_PER_THREAD = 16

# Per-record outcomes of read_records (landing.c).
OK, SHORT, BAD_RECORD, BAD_SHARD, WRONG_VERSION, IO_ERROR, NOT_PERMITTED = range(7)
MAX_RECORD_HEADER_BYTES = 4096  # longer record headers (huge names) read through Python


@dataclass(frozen=True)
class Place:
    """Where one key's data shard goes in the client's landing pool: the block's first byte
    is at ``offset``; shard ``shard_index`` (of ``payload_bytes``) lands at
    ``offset + shard_index * payload_bytes``, and must end within ``capacity_bytes``."""

    offset: int
    capacity_bytes: int
    shard_index: int
    payload_bytes: int

    def range_for(self, shard_index: int, payload_bytes: int) -> tuple[int, int] | None:
        """The pool byte range a stored shard of this index and length goes to, or None when
        it is not the shard this place expects (then it travels through the arena)."""
        if shard_index != self.shard_index or payload_bytes != self.payload_bytes:
            return None
        start = shard_index * payload_bytes
        if payload_bytes == 0 or start + payload_bytes > self.capacity_bytes:
            return None
        return self.offset + start, self.offset + start + payload_bytes


# A READ's places as they travel (kvstore/wire/local_frames.py): one 24-byte row per key.
PLACE_DTYPE = np.dtype(
    [
        ("offset", "<u8"),  # NO_PLACE: the key has none
        ("capacity_bytes", "<u8"),
        ("payload_bytes", "<u4"),
        ("shard_index", "u1"),
        ("_zero", "V3"),
    ]
)
NO_PLACE = (1 << 64) - 1


def places_from_rows(rows: np.ndarray) -> list[Place | None]:
    """The :class:`Place` of each row of a PLACE_DTYPE array (None where it has none)."""
    return [
        None if offset == NO_PLACE else Place(offset, capacity, index, payload)
        for offset, capacity, payload, index in zip(
            rows["offset"].tolist(),
            rows["capacity_bytes"].tolist(),
            rows["payload_bytes"].tolist(),
            rows["shard_index"].tolist(),
            strict=True,
        )
    ]


@dataclass(frozen=True)
class Permit:
    """A request's permit word: its address in the node's mapping and its ARMED value."""

    address: int
    armed: int


@dataclass(frozen=True)
class PoolLanding:
    """A local READ's landing as the node sees it: the client's pool (the node's mapping of
    it), per request key a :class:`Place` or None (through the arena), and the request's
    permit word."""

    memory: memoryview
    address: int  # where ``memory`` starts in the node's process
    places: Sequence[Place | None]
    permit: Permit | None


def permit_value(generation: int, state: int) -> int:
    return (generation << 2 | state) & 0xFFFFFFFF


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KVSTORE_NATIVE", "1") == "0" or not LIBRARY_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as exc:
        log.warning("not using %s (%s): local reads land through the arena", LIBRARY_PATH, exc)
        return None
    u32, ptr = ctypes.c_uint32, ctypes.c_void_p
    lib.kv_permit_cas.argtypes = [ptr, u32, u32]
    lib.kv_permit_cas.restype = u32
    lib.kv_permit_load.argtypes = [ptr]
    lib.kv_permit_load.restype = u32
    lib.kv_permit_store.argtypes = [ptr, u32]
    lib.kv_permit_store.restype = None
    lib.kv_read_records.argtypes = [
        ctypes.c_size_t,
        *[ptr] * 10,
        u32,
        ptr,
        u32,
        ptr,
        ptr,
        ptr,
        ctypes.c_size_t,
    ]
    lib.kv_read_records.restype = ctypes.c_size_t
    return lib


_lib = _load()
NATIVE = _lib is not None


def permit_cas(address: int, expected: int, desired: int) -> int:
    """Compare-and-swap a permit word; the value it held (== ``expected``: it swapped)."""
    assert _lib is not None, "permits need kvstore/wire/_landing.so (make native)"
    return int(_lib.kv_permit_cas(address, expected, desired))


def permit_load(address: int) -> int:
    assert _lib is not None, "permits need kvstore/wire/_landing.so (make native)"
    return int(_lib.kv_permit_load(address))


def permit_store(address: int, value: int) -> None:
    assert _lib is not None, "permits need kvstore/wire/_landing.so (make native)"
    _lib.kv_permit_store(address, value)


@dataclass
class RecordReads:
    """The inputs of one :func:`read_records` call, one row per record (numpy columns)."""

    fds: np.ndarray  # int32
    offsets: np.ndarray  # uint64
    header_bytes: np.ndarray  # uint32
    payload_bytes: np.ndarray  # uint64
    destinations: np.ndarray  # uint64 addresses
    in_pool: np.ndarray  # uint8
    keys: bytes  # 16 bytes each
    versions: bytes  # 16 bytes each


def read_records(
    reads: RecordReads, tenant_hash: bytes, tenant: str, permit: Permit | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read every record of ``reads`` (landing.c's kv_read_records): per record its outcome
    (OK, ...), the errno of an IO_ERROR, and its 48-byte shard header (rows of a uint8
    array). The caller keeps every destination mapped across the call."""
    assert _lib is not None, "read_records needs kvstore/wire/_landing.so (make native)"
    n = len(reads.fds)
    status = np.zeros(n, np.uint8)
    errnos = np.zeros(n, np.int32)
    headers = np.zeros((n, 48), np.uint8)
    name = tenant.encode()
    _lib.kv_read_records(
        n,
        reads.fds.ctypes.data,
        reads.offsets.ctypes.data,
        reads.header_bytes.ctypes.data,
        reads.payload_bytes.ctypes.data,
        reads.destinations.ctypes.data,
        reads.in_pool.ctypes.data,
        reads.keys,
        reads.versions,
        tenant_hash,
        name,
        len(name),
        permit.address if permit else None,
        permit.armed if permit else 0,
        headers.ctypes.data,
        status.ctypes.data,
        errnos.ctypes.data,
        max(1, min(READ_THREADS, n // RECORDS_PER_THREAD)),
    )
    return status, errnos, headers
