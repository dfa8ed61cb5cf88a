"""Append-only segment files: where a node keeps shard bytes.

A node's data directory::

    DATA_DIR/
      index/              lmdb environment (kvstore/index.py): the commit point
      segments/
        000000000001.seg  one append-only file per (expiry window, fill): records back to back
        000000000002.seg
        ...

One record per stored shard; the shard bytes are exactly what the client sent (erasure/shard.py
header + payload), so a read returns them with one ``pread`` and no re-encoding::

    offset size  field                                   (little-endian)
    ------ ----  ----------------------------------------------------------
         0    4  magic b"KVR1"
         4    4  shard length in bytes (n)
         8   16  block key
        24    8  tenant hash (first 8 bytes of the index key, see kvstore/index.py)
        32    8  record checksum: xxh3-64 of bytes [0, 32)
        40    n  shard: 48-byte shard header + payload (carries its own xxh3-64)

Why a record header when the shard checks itself: a shard proves only that its own bytes are
intact. The record header proves the bytes at this offset belong to *this* key and tenant, so a
wrong or stale index entry (or a recycled file) can never serve another key's valid shard.

Files are only ever appended to by the single writer, truncated back to the length the index
last committed (a torn tail after a crash, or a put that failed before its commit), or have
the records of deleted shards destroyed in place (:meth:`SegmentFiles.erase`: a hole punched
with ``fallocate``, or zeros written where the filesystem cannot punch). Readers open the file
per request, so a segment deleted by expiry while a read is in flight shows up as
``FileNotFoundError`` (a miss after a re-check), never as bytes of a recycled descriptor.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import xxhash

from kvstore.errors import CapacityExhausted, ChecksumMismatch

log = logging.getLogger(__name__)

RECORD_MAGIC = b"KVR1"
RECORD_HEADER_BYTES = 40
_RECORD = struct.Struct("<4sI16s8s")  # bytes [0, 32)
_CHECKSUM = struct.Struct("<Q")
assert _RECORD.size + _CHECKSUM.size == RECORD_HEADER_BYTES
_SUFFIX = ".seg"
# fallocate(2) modes: deallocate a byte range, keep the file's size (reads there give zeros).
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_ZEROS = bytes(1 << 20)


def _load_fallocate() -> ctypes._CFuncPtr | None:
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not Linux/glibc: erase writes zeros instead
        return None
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fallocate.restype = ctypes.c_int
    return fallocate


_fallocate = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``[offset, offset + length)`` of ``fd``; False where the filesystem cannot."""
    if _fallocate is None:
        return False
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _fallocate(fd, mode, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")


def overwrite_with_zeros(fd: int, offset: int, length: int) -> None:
    """Write zeros over ``[offset, offset + length)`` (where holes cannot be punched)."""
    end = offset + length
    while offset < end:
        offset += os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - offset)], offset)


def pack_record_header(key: bytes, tenant_hash: bytes, shard_bytes: int) -> bytes:
    """The 40-byte header written in front of a shard of ``shard_bytes`` bytes."""
    fields = _RECORD.pack(RECORD_MAGIC, shard_bytes, key, tenant_hash)
    return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))


def check_record_header(header: bytes, key: bytes, tenant_hash: bytes, shard_bytes: int) -> None:
    """Raise ChecksumMismatch unless ``header`` is intact and describes this key's shard."""
    if len(header) != RECORD_HEADER_BYTES:
        raise ChecksumMismatch(f"record header cut short: {len(header)} of 40 bytes on disk")
    (stored,) = _CHECKSUM.unpack_from(header, _RECORD.size)
    if xxhash.xxh3_64_intdigest(header[: _RECORD.size]) != stored:
        raise ChecksumMismatch("segment record header fails its checksum")
    if header[: _RECORD.size] != _RECORD.pack(RECORD_MAGIC, shard_bytes, key, tenant_hash):
        raise ChecksumMismatch(f"segment record does not hold key {key.hex()} as indexed")


def record_bytes(shard_bytes: int) -> int:
    """Bytes a shard of ``shard_bytes`` takes in a segment."""
    return RECORD_HEADER_BYTES + shard_bytes


class SegmentFiles:
    """The ``segments/`` folder: append, sync, truncate, read and remove segment files.

    Not thread-safe for writers (the store serializes writes); reads may run concurrently.
    """

    def __init__(self, directory: Path, *, fsync: bool) -> None:
        self.directory = directory
        self.fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)
        self._write_fds: dict[int, int] = {}
        self._dir_dirty = False  # a file was created: its name is durable only after a dir fsync

    def path(self, segment_id: int) -> Path:
        return self.directory / f"{segment_id:012d}{_SUFFIX}"

    def ids_on_disk(self) -> set[int]:
        """Segment ids of every ``*.seg`` file present (committed or orphaned)."""
        return {int(p.stem) for p in self.directory.glob(f"*{_SUFFIX}") if p.stem.isdigit()}

    def size(self, segment_id: int) -> int | None:
        """File size in bytes, or None if the file is missing."""
        try:
            return self.path(segment_id).stat().st_size
        except FileNotFoundError:
            return None

    def append(self, segment_id: int, offset: int, chunks: Sequence[bytes | memoryview]) -> None:
        """Write ``chunks`` at ``offset`` (the segment's end); ENOSPC -> CapacityExhausted."""
        fd = self._write_fd(segment_id)
        try:
            written = os.pwritev(fd, chunks, offset)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CapacityExhausted(
                    f"disk full while appending to segment {segment_id}: {exc}"
                ) from exc
            raise
        expected = sum(len(c) for c in chunks)
        if written != expected:
            raise OSError(f"short write to segment {segment_id}: {written} of {expected} bytes")

    def sync(self, segment_ids: Iterable[int]) -> None:
        """fsync each segment once (per request, not per record), if fsync is configured."""
        if not self.fsync:
            return
        for segment_id in segment_ids:
            os.fdatasync(self._write_fd(segment_id))
        if self._dir_dirty:
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self._dir_dirty = False

    def truncate(self, segment_id: int, length: int) -> None:
        """Cut the file back to ``length`` bytes: drops a torn or uncommitted tail."""
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.path(segment_id), length)

    def erase(self, segment_id: int, offset: int, length: int) -> None:
        """Destroy the bytes of a record in place: reads of the range give zeros from now on.

        A punched hole frees the filesystem blocks; where the filesystem cannot punch, the
        range is overwritten with zeros. Synced when fsync is configured. A segment already
        gone needs nothing.
        """
        try:
            fd = os.open(self.path(segment_id), os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            if not punch_hole(fd, offset, length):
                overwrite_with_zeros(fd, offset, length)
            if self.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def remove(self, segment_id: int) -> None:
        """Close and unlink a segment (readers in flight get FileNotFoundError on open)."""
        self.close_writer(segment_id)
        with contextlib.suppress(FileNotFoundError):
            self.path(segment_id).unlink()

    def close_writer(self, segment_id: int) -> None:
        fd = self._write_fds.pop(segment_id, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for segment_id in list(self._write_fds):
            self.close_writer(segment_id)

    def read_shard(
        self, segment_id: int, offset: int, shard_bytes: int, key: bytes, tenant_hash: bytes
    ) -> bytes:
        """The shard bytes of the record at ``offset``, after checking its record header.

        Raises FileNotFoundError if the segment is gone, ChecksumMismatch if the record is not
        the one indexed. The shard's own checksum is the caller's to verify.
        """
        fd = os.open(self.path(segment_id), os.O_RDONLY)
        try:
            header = os.pread(fd, RECORD_HEADER_BYTES, offset)
            check_record_header(header, key, tenant_hash, shard_bytes)
            shard = os.pread(fd, shard_bytes, offset + RECORD_HEADER_BYTES)
        finally:
            os.close(fd)
        if len(shard) != shard_bytes:
            raise ChecksumMismatch(f"segment {segment_id} ends inside the record at {offset}")
        return shard

    def open_reader(self, segment_id: int) -> int:
        """A read-only descriptor of the segment (FileNotFoundError if it is gone); the caller
        closes it. One per segment per batch: every record of it is then one ``preadv``."""
        return os.open(self.path(segment_id), os.O_RDONLY)

    @staticmethod
    def read_into(
        fd: int,
        offset: int,
        payload: memoryview,
        key: bytes,
        tenant_hash: bytes,
        head: bytearray,
    ) -> memoryview:
        """Read the record at ``offset`` with one ``preadv``: record and shard headers into
        ``head`` (``RECORD_HEADER_BYTES + 48`` bytes), the payload straight into ``payload``.

        Returns the 48-byte shard header (a view of ``head``) once the record header proved
        the bytes are this key's; the shard checksum is the caller's to verify.
        """
        num_read = os.preadv(fd, [head, payload], offset)
        if num_read != len(head) + len(payload):
            raise ChecksumMismatch(f"segment ends inside the record at {offset}")
        shard_bytes = len(head) - RECORD_HEADER_BYTES + len(payload)
        check_record_header(bytes(head[:RECORD_HEADER_BYTES]), key, tenant_hash, shard_bytes)
        return memoryview(head)[RECORD_HEADER_BYTES:]

    def _write_fd(self, segment_id: int) -> int:
        fd = self._write_fds.get(segment_id)
        if fd is None:
            fd = os.open(self.path(segment_id), os.O_WRONLY | os.O_CREAT, 0o644)
            self._write_fds[segment_id] = fd
            self._dir_dirty = True
        return fd
