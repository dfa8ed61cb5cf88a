"""Append-only segment files: where a node keeps shard bytes.

A node's data directory::

    DATA_DIR/
      index/              lmdb environment (kvstore/store/index_backends.py): the commit point
      segments/
        000000000001.seg  one append-only file per (expiry window, fill): records back to back
        000000000002.seg
        ...
      quarantine/         segment files holding bytes no index entry accounts for (never deleted
                          by the node: kvstore/store/index_rebuild.py)

One record per stored shard; the shard bytes are exactly what the client sent (erasure/shard.py
header + payload), so a read returns them with one ``pread`` and no re-encoding. Record format 2
(``KVR2``) describes itself, so a lost index can be rebuilt from the segments alone::

    offset  size  field                                   (little-endian)
    ------  ----  ----------------------------------------------------------
         0     4  magic b"KVR2"
         4     4  shard length in bytes (n)
         8    16  block key
        24     8  tenant hash (first 8 bytes of the index key, see kvstore/store/index_codec.py)
        32     8  written_at_s (f64): when the block version was written (newest wins)
        40     8  expires_at_s (f64, inf = never) when this record was written
        48     1  traffic class length (c)
        49     1  shard index
        50     2  tenant length in utf-8 bytes (t)
        52     c  traffic class (ascii)
      52+c     t  tenant (utf-8)
    52+c+t     8  record checksum: xxh3-64 of bytes [0, 52+c+t)
    60+c+t     n  shard: 48-byte shard header + payload (carries its own xxh3-64)

Format 1 (``KVR1``, written before the format bump) has no times, class, shard index or tenant
name; it is still read (its 40-byte header is magic, n, key, tenant hash, checksum of the
first 32 bytes), and start-up rewrites such records as format 2 (kvstore/store/migration.py).

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
import functools
import logging
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from erasure.shard import HEADER_BYTES as SHARD_HEADER_BYTES
from kvstore.errors import CapacityExhausted, ChecksumMismatch

log = logging.getLogger(__name__)

RECORD_MAGIC = b"KVR2"
RECORD_FORMAT = 2
LEGACY_MAGIC = b"KVR1"
LEGACY_HEADER_BYTES = 40
_FIXED = struct.Struct("<4sI16s8sddBBH")  # bytes [0, 52) of a format-2 header
_LEGACY = struct.Struct("<4sI16s8s")  # bytes [0, 32) of a format-1 header
_CHECKSUM = struct.Struct("<Q")
MIN_HEADER_BYTES = _FIXED.size + _CHECKSUM.size
assert _LEGACY.size + _CHECKSUM.size == LEGACY_HEADER_BYTES
_SUFFIX = ".seg"
_SCAN_CHUNK_BYTES = 1 << 20
# fallocate(2) modes: deallocate a byte range, keep the file's size (reads there give zeros).
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_ZEROS = bytes(1 << 20)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


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


def whole_zero_pages(fd: int, offset: int, length: int) -> tuple[int, int]:
    """``[offset, offset + length)`` as (offset, length) widened to the filesystem blocks at
    its ends wherever the bytes the widening adds already read as zeros.

    A punch frees only the blocks wholly inside its range, so records punched one by one
    left the block each shares with its neighbour allocated: a page per record, for good (a
    2 MiB disk of 13 KB shards lost over half its room to them, and the node refused puts).
    Bytes that read as zeros are the erased neighbour's (or the file's unwritten end), and a
    punch leaves them reading as zeros: widening over them changes no byte anyone can read,
    whoever they belong to. So the last of two neighbours to go frees the block they share.
    """
    block = os.fstat(fd).st_blksize or 4096
    start, end = offset - offset % block, -(-(offset + length) // block) * block
    if start < offset and os.pread(fd, offset - start, start).strip(b"\0"):
        start = offset
    if end > offset + length and os.pread(fd, end - offset - length, offset + length).strip(b"\0"):
        end = offset + length
    return start, end - start


def overwrite_with_zeros(fd: int, offset: int, length: int) -> None:
    """Write zeros over ``[offset, offset + length)`` (where holes cannot be punched)."""
    end = offset + length
    while offset < end:
        offset += os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - offset)], offset)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A parsed record header (format 1 headers leave the fields they lack at their defaults)."""

    key: bytes
    tenant_hash: bytes
    shard_bytes: int
    header_bytes: int
    record_format: int = RECORD_FORMAT
    tenant: str = ""
    traffic_class: str = ""
    shard_index: int = 0
    written_at_s: float = 0.0
    expires_at_s: float = 0.0

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.shard_bytes


@functools.lru_cache(maxsize=4096)
def header_bytes(tenant: str, traffic_class: str, record_format: int = RECORD_FORMAT) -> int:
    """Bytes of the record header in front of a shard of this tenant and class (cached: every
    entry's size needs it, and a store serves few tenants and classes)."""
    if record_format == 1:
        return LEGACY_HEADER_BYTES
    return MIN_HEADER_BYTES + len(traffic_class.encode()) + len(tenant.encode())


def record_bytes(shard_bytes: int, tenant: str, traffic_class: str) -> int:
    """Bytes a shard of ``shard_bytes`` takes in a segment (format-2 record)."""
    return header_bytes(tenant, traffic_class) + shard_bytes


def pack_record_header(
    key: bytes,
    tenant_hash: bytes,
    shard_bytes: int,
    *,
    tenant: str,
    traffic_class: str,
    shard_index: int,
    written_at_s: float,
    expires_at_s: float,
) -> bytes:
    """The format-2 header written in front of a shard of ``shard_bytes`` bytes."""
    cls, name = traffic_class.encode(), tenant.encode()
    fields = _FIXED.pack(
        RECORD_MAGIC,
        shard_bytes,
        key,
        tenant_hash,
        written_at_s,
        expires_at_s,
        len(cls),
        shard_index,
        len(name),
    )
    fields += cls + name
    return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))


def parse_record_header(buffer: bytes | memoryview) -> RecordHeader:
    """The header at the start of ``buffer`` (which may hold more); ChecksumMismatch if it is
    not an intact record header of either format."""
    view = memoryview(buffer)
    magic = bytes(view[:4])
    if magic == LEGACY_MAGIC and len(view) >= LEGACY_HEADER_BYTES:
        _, shard_bytes, key, th = _LEGACY.unpack_from(view)
        _check_sum(view, _LEGACY.size)
        return RecordHeader(key, th, shard_bytes, LEGACY_HEADER_BYTES, record_format=1)
    if magic != RECORD_MAGIC or len(view) < MIN_HEADER_BYTES:
        raise ChecksumMismatch(f"no record header here (magic {magic!r}, {len(view)} bytes)")
    _, shard_bytes, key, th, written_at_s, expires_at_s, cls_len, index, name_len = (
        _FIXED.unpack_from(view)
    )
    end = _FIXED.size + cls_len + name_len
    if len(view) < end + _CHECKSUM.size:
        raise ChecksumMismatch(f"record header cut short: {len(view)} of {end + 8} bytes")
    _check_sum(view, end)
    try:
        traffic_class = bytes(view[_FIXED.size : _FIXED.size + cls_len]).decode()
        tenant = bytes(view[_FIXED.size + cls_len : end]).decode()
    except UnicodeDecodeError as exc:
        raise ChecksumMismatch(f"record header names no valid class or tenant: {exc}") from None
    return RecordHeader(
        key,
        th,
        shard_bytes,
        end + _CHECKSUM.size,
        tenant=tenant,
        traffic_class=traffic_class,
        shard_index=index,
        written_at_s=written_at_s,
        expires_at_s=expires_at_s,
    )


def _check_sum(view: memoryview, end: int) -> None:
    (stored,) = _CHECKSUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored:
        raise ChecksumMismatch("segment record header fails its checksum")


def check_record_header(
    header: bytes | memoryview, key: bytes, tenant_hash: bytes, tenant: str, shard_bytes: int
) -> RecordHeader:
    """Raise ChecksumMismatch unless ``header`` is intact and describes this key's shard."""
    parsed = parse_record_header(header)
    if parsed.header_bytes != len(header):
        raise ChecksumMismatch(f"record header is {parsed.header_bytes} bytes, not {len(header)}")
    same = (parsed.key, parsed.tenant_hash, parsed.shard_bytes) == (key, tenant_hash, shard_bytes)
    if not same or (parsed.record_format > 1 and parsed.tenant != tenant):
        raise ChecksumMismatch(f"segment record does not hold key {key.hex()} as indexed")
    return parsed


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A record found by :meth:`SegmentFiles.scan`: where it is and what its header says."""

    offset: int
    header: RecordHeader


@dataclass(frozen=True, slots=True)
class UnaccountedBytes:
    """Bytes of a segment that are no intact record (torn, overwritten, or of another file)."""

    offset: int
    num_bytes: int


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
        # Whether the last erase freed its range (a punched hole) or wrote zeros over it: dead
        # records hold no disk space in the first case (kvstore/store/eviction.py held_bytes).
        self.punches_holes = True

    def path(self, segment_id: int) -> Path:
        return self.directory / f"{segment_id:012d}{_SUFFIX}"

    @property
    def quarantine_dir(self) -> Path:
        return self.directory.parent / "quarantine"

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
        """Write ``chunks`` at ``offset`` (the segment's end): one ``pwritev`` per
        ``IOV_MAX`` chunks, so a batch of records costs one system call.

        A full disk (ENOSPC, EDQUOT, or a short write, which is how a filesystem that ran out
        of space mid-write answers) raises CapacityExhausted.
        """
        fd = self._write_fd(segment_id)
        for start in range(0, len(chunks), _IOV_MAX):
            run = chunks[start : start + _IOV_MAX]
            try:
                written = os.pwritev(fd, run, offset)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CapacityExhausted(
                        f"disk full while appending to segment {segment_id}: {exc}"
                    ) from exc
                raise
            expected = sum(len(c) for c in run)
            if written != expected:
                raise CapacityExhausted(
                    f"disk full while appending to segment {segment_id}: wrote {written} of "
                    f"{expected} bytes"
                )
            offset += written

    def sync(self, segment_ids: Iterable[int]) -> None:
        """fsync each segment once (per request, not per record), if fsync is configured."""
        if not self.fsync:
            return
        for segment_id in segment_ids:
            os.fdatasync(self._write_fd(segment_id))
        if self._dir_dirty:
            self.sync_directory(self.directory)
            self._dir_dirty = False

    @staticmethod
    def sync_directory(directory: Path) -> None:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

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
            fd = os.open(self.path(segment_id), os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            self.punches_holes = punch_hole(fd, *whole_zero_pages(fd, offset, length))
            if not self.punches_holes:
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

    def quarantine(self, segment_id: int, reason: str) -> Path:
        """Move a segment file into ``quarantine/`` (kept, out of the store's way)."""
        self.close_writer(segment_id)
        self.quarantine_dir.mkdir(exist_ok=True)
        target = self.quarantine_dir / f"{self.path(segment_id).name}.{reason}"
        os.replace(self.path(segment_id), target)
        if self.fsync:
            self.sync_directory(self.quarantine_dir)
            self.sync_directory(self.directory)
        return target

    def quarantined_bytes(self) -> int:
        """Bytes of the files in ``quarantine/``."""
        if not self.quarantine_dir.exists():
            return 0
        return sum(p.stat().st_size for p in self.quarantine_dir.iterdir() if p.is_file())

    def close_writer(self, segment_id: int) -> None:
        fd = self._write_fds.pop(segment_id, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for segment_id in list(self._write_fds):
            self.close_writer(segment_id)

    def read_shard(
        self,
        segment_id: int,
        offset: int,
        header_bytes: int,
        shard_bytes: int,
        key: bytes,
        tenant: str,
        tenant_hash: bytes,
    ) -> bytes:
        """The shard bytes of the record at ``offset``, after checking its record header.

        Raises FileNotFoundError if the segment is gone, ChecksumMismatch if the record is not
        the one indexed. The shard's own checksum is the caller's to verify.
        """
        fd = os.open(self.path(segment_id), os.O_RDONLY)
        try:
            header = os.pread(fd, header_bytes, offset)
            check_record_header(header, key, tenant_hash, tenant, shard_bytes)
            shard = os.pread(fd, shard_bytes, offset + header_bytes)
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
        header_bytes: int,
        payload: memoryview,
        key: bytes,
        tenant_hash: bytes,
        tenant: str,
        head: bytearray,
    ) -> memoryview:
        """Read the record at ``offset`` with one ``preadv``: its ``header_bytes`` of record
        header (they vary with the tenant and class names, :func:`header_bytes`) and the
        48-byte shard header into ``head`` (at least ``header_bytes + 48`` bytes), the
        payload straight into ``payload``.

        Returns the 48-byte shard header (a view of ``head``) once the record header proved
        the bytes are this key's and this tenant's; the shard checksum is the caller's to
        verify.
        """
        heads = memoryview(head)[: header_bytes + SHARD_HEADER_BYTES]
        num_read = os.preadv(fd, [heads, payload], offset)
        if num_read != len(heads) + len(payload):
            raise ChecksumMismatch(f"segment ends inside the record at {offset}")
        shard_bytes = SHARD_HEADER_BYTES + len(payload)
        check_record_header(heads[:header_bytes], key, tenant_hash, tenant, shard_bytes)
        return heads[header_bytes:]

    def read_at(self, segment_id: int, offset: int, num_bytes: int) -> bytes:
        """Raw bytes of a segment (FileNotFoundError if it is gone)."""
        fd = os.open(self.path(segment_id), os.O_RDONLY)
        try:
            return os.pread(fd, num_bytes, offset)
        finally:
            os.close(fd)

    def scan(self, segment_id: int) -> Iterator[ScannedRecord | UnaccountedBytes]:
        """Every record of a segment in file order, and the runs of bytes between them that are
        no intact record header (after such a run the scan resumes at the next magic whose
        header verifies). A record whose shard runs past the end of the file is unaccounted;
        a run of zeros is not (a deleted record erased in place, :meth:`erase`). Shard bytes
        are not verified here: the caller reads and checks them."""
        size = self.size(segment_id) or 0
        offset, gap_start = 0, None
        while offset < size:
            header = self._header_at(segment_id, offset)
            if header is not None and offset + header.record_bytes <= size:
                if gap_start is not None:
                    yield from self._gap(segment_id, gap_start, offset)
                    gap_start = None
                yield ScannedRecord(offset, header)
                offset += header.record_bytes
                continue
            if gap_start is None:
                gap_start = offset
            offset = self._next_magic(segment_id, offset + 1, size)
        if gap_start is not None:
            yield from self._gap(segment_id, gap_start, size)

    def _gap(self, segment_id: int, start: int, end: int) -> Iterator[UnaccountedBytes]:
        """The run ``[start, end)`` as unaccounted bytes, unless it is all zeros (erased)."""
        for offset in range(start, end, _SCAN_CHUNK_BYTES):
            chunk = self.read_at(segment_id, offset, min(_SCAN_CHUNK_BYTES, end - offset))
            if chunk.count(0) != len(chunk):
                yield UnaccountedBytes(start, end - start)
                return

    def _header_at(self, segment_id: int, offset: int) -> RecordHeader | None:
        head = self.read_at(segment_id, offset, MIN_HEADER_BYTES)
        if head[:4] == RECORD_MAGIC and len(head) == MIN_HEADER_BYTES:
            cls_len, _, name_len = struct.unpack_from("<BBH", head, 48)
            head = self.read_at(segment_id, offset, MIN_HEADER_BYTES + cls_len + name_len)
        try:
            return parse_record_header(head)
        except ChecksumMismatch:
            return None

    def _next_magic(self, segment_id: int, start: int, size: int) -> int:
        """Offset of the next ``KVR2``/``KVR1`` at or after ``start`` (``size`` if none)."""
        offset = start
        while offset < size:
            chunk = self.read_at(segment_id, offset, _SCAN_CHUNK_BYTES + 3)
            hits = [i for i in (chunk.find(RECORD_MAGIC), chunk.find(LEGACY_MAGIC)) if i >= 0]
            if hits:
                return offset + min(hits)
            offset += _SCAN_CHUNK_BYTES
        return size

    def _write_fd(self, segment_id: int) -> int:
        fd = self._write_fds.get(segment_id)
        if fd is None:
            fd = os.open(self.path(segment_id), os.O_WRONLY | os.O_CREAT, 0o644)
            self._write_fds[segment_id] = fd
            self._dir_dirty = True
        return fd
