"""One batch read's records, read into their destinations in one pass: the node's read loop.

:class:`kvstore.store.shard_reader.ShardReader` decides from the index which record each key
serves and where its payload goes (the answer's payload stream, or a place in a local client's
landing pool, kvstore/wire/landing.py); this module reads them all::

    per record   open its segment (once per segment)  -> gone: the key is looked up again
    all records  ONE native call (kvstore/wire/landing.c, no GIL): per record a preadv of the
                 record header, the shard header and the payload (to its destination), the
                 record header checked (key, tenant, checksum), the shard checksum and its
                 version against the index
                 or, without the native loop (or for a format-1 record), the same per record
                 in Python (SegmentFiles.read_into and erasure.shard.verify_shard)
    per record   its outcome: the shard header (served), corrupt, or withheld (the client
                 revoked the request before the node wrote into its pool)

A record that fails its checks in memory the client can write (its arena or pool) is read
again into private memory before it is taken for corrupt, so a client cannot make a node drop
good shards. The module's one dense hot path is :func:`read_records`.
"""

from __future__ import annotations

import ctypes
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from erasure.shard import HEADER_BYTES, SplitShard, verify_shard
from kvstore.errors import ChecksumMismatch, CodecError
from kvstore.store.index_codec import Entry, tenant_hash
from kvstore.store.segments import RECORD_FORMAT, SegmentFiles
from kvstore.wire import landing


class Outcome(enum.Enum):
    SERVED = "served"
    GONE = "gone"  # the segment was deleted or moved before we opened it
    CORRUPT = "corrupt"
    # Intact but not served: the client revoked the request before the node could write into
    # its landing pool, or changed the bytes in shared memory under the node.
    WITHHELD = "withheld"


@dataclass
class RecordRead:
    """One record to read: the key's position in the batch, its index entry, where its
    payload goes (a view and its address in this process), and whether that is a local
    client's landing pool."""

    position: int
    entry: Entry
    destination: memoryview
    address: int
    in_pool: bool = False
    outcome: Outcome = Outcome.GONE
    shard_header: bytes = b""  # SERVED: the 48-byte shard header


def read_records(
    files: SegmentFiles,
    tenant: str,
    reads: Sequence[RecordRead],
    *,
    shared: bool,
    permit: landing.Permit | None = None,
) -> None:
    """Read every record of ``reads`` into its destination and set its outcome (see the
    module doc). ``shared``: the stream destinations are memory a client can write too."""
    fds: dict[int, int] = {}
    try:
        opened = [r for r in reads if _open(files, r, fds)]
        native = [r for r in opened if _native_ok(r)]
        if native:
            _read_native(native, fds, tenant, permit)
        for read in opened:
            if read.outcome is Outcome.GONE:  # not read natively
                _read_python(read, fds, tenant, permit)
        for read in opened:
            if read.outcome is Outcome.CORRUPT and (shared or read.in_pool):
                _read_again_privately(read, fds, tenant)
    finally:
        for fd in fds.values():
            os.close(fd)


def _open(files: SegmentFiles, read: RecordRead, fds: dict[int, int]) -> bool:
    segment_id = read.entry.segment_id
    if segment_id not in fds:
        try:
            fds[segment_id] = files.open_reader(segment_id)
        except FileNotFoundError:
            return False
    return True


def _native_ok(read: RecordRead) -> bool:
    entry = read.entry
    return (
        landing.NATIVE
        and entry.record_format == RECORD_FORMAT
        and entry.header_bytes <= landing.MAX_RECORD_HEADER_BYTES
    )


def _read_native(
    reads: Sequence[RecordRead], fds: dict[int, int], tenant: str, permit: landing.Permit | None
) -> None:
    """The whole batch in one native call (the hot path)."""
    entries = [r.entry for r in reads]
    batch = landing.RecordReads(
        fds=np.array([fds[e.segment_id] for e in entries], np.int32),
        offsets=np.array([e.offset for e in entries], np.uint64),
        header_bytes=np.array([e.header_bytes for e in entries], np.uint32),
        payload_bytes=np.array([len(r.destination) for r in reads], np.uint64),
        destinations=np.array([r.address for r in reads], np.uint64),
        in_pool=np.array([r.in_pool for r in reads], np.uint8),
        keys=b"".join(e.key for e in entries),
        versions=b"".join(e.version for e in entries),
    )
    status, errnos, headers = landing.read_records(batch, tenant_hash(tenant), tenant, permit)
    for read, code, errno, header in zip(
        reads, status.tolist(), errnos.tolist(), headers, strict=True
    ):
        if code == landing.OK:
            read.outcome, read.shard_header = Outcome.SERVED, header.tobytes()
        elif code == landing.NOT_PERMITTED:
            read.outcome = Outcome.WITHHELD
        elif code == landing.IO_ERROR:
            raise OSError(errno, f"reading segment {read.entry.segment_id}: {os.strerror(errno)}")
        else:
            read.outcome = Outcome.CORRUPT


def _read_python(
    read: RecordRead, fds: dict[int, int], tenant: str, permit: landing.Permit | None
) -> None:
    """One record through Python (no native loop, or a format-1 record). Never into a pool:
    only the native loop holds permits, and nodes without it place nothing."""
    if read.in_pool:
        read.outcome = Outcome.WITHHELD
        return
    try:
        read.shard_header = _read_checked(fds[read.entry.segment_id], read.entry, read, tenant)
        read.outcome = Outcome.SERVED
    except CodecError:
        read.outcome = Outcome.CORRUPT


def _read_checked(fd: int, entry: Entry, read: RecordRead, tenant: str) -> bytes:
    head = bytearray(entry.header_bytes + HEADER_BYTES)
    header = SegmentFiles.read_into(
        fd,
        entry.offset,
        entry.header_bytes,
        read.destination,
        entry.key,
        tenant_hash(tenant),
        tenant,
        head,
    )
    if verify_shard(SplitShard(header, read.destination)).block_checksum != entry.version:
        raise ChecksumMismatch("shard version differs from the indexed version")
    return bytes(header)


def _read_again_privately(read: RecordRead, fds: dict[int, int], tenant: str) -> None:
    """A record that failed in shared memory, read again where only this process writes: if
    it verifies there, the client changed the bytes under us (not served, not corrupt)."""
    buffer = bytearray(len(read.destination))
    private = RecordRead(read.position, read.entry, memoryview(buffer), address_of(buffer))
    try:
        _read_checked(fds[read.entry.segment_id], read.entry, private, tenant)
    except CodecError:
        return
    read.outcome = Outcome.WITHHELD


def address_of(buffer: bytearray | memoryview) -> int:
    """Where a writable buffer's first byte lies in this process (0 for an empty one)."""
    if not len(buffer):
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
