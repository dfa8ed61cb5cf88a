"""The node's index: where every committed shard lives, when it expires, what each segment holds.

One :class:`Index` over a small ordered key-value backend with transactions: lmdb on a node
(:class:`LmdbBackend`) and a sorted in-memory twin (:class:`MemoryBackend`) for unit tests and
the simulator. The index logic (key encodings, secondary indexes, derived counters) is written
once, so both backends behave identically and one test suite runs against both.

Sub-databases and their keys (``th`` = 8-byte tenant hash, integers big-endian so byte order is
numeric order)::

    entries   th(8) key(16) version(16)                -> entry value (below)
    expiry    expires_at_us(8) th key version           -> b""    earliest expiry first: expiry
                                                                   (and eviction in that order)
                                                                   is a range scan from the start
    access    last_access_us(8) th key version          -> b""    least recently accessed first,
                                                                   entries that can expire only:
                                                                   LRU eviction is a range scan
    by_seg    segment_id(8) th key version              -> b""    a segment's entries, for
                                                                   carry-forward and compaction
    by_group  group(4) th key version                   -> b""    a placement group's entries,
                                                                   for the repair's listing
    segments  segment_id(8)                             -> window_id(i64) committed_bytes(u64)
                                                           live_bytes(u64) num_live(u64)
    quarantined segment_id(8)                           -> reason (utf-8): moved to
                                                           quarantine/, not deleted, when freed
    deleted   th key (or th alone: a purge)             -> deleted_at_s(f64) tenant (utf-8):
                                                           the delete log by key, for the
                                                           repair rule (kvstore/store/deletion.py)
    deleted_time deleted_at_us(8) th key                -> b""    the same, oldest first
    counters  name (utf-8)                              -> f64     stats kept across restarts
    erase     segment_id(8) offset(8)                   -> record bytes(u64): records of deleted
                                                                   shards whose bytes are still
                                                                   to be destroyed on disk
    tombstones seq(8)                                   -> at_s(f64) key length(u8) key
                                                           tenant (utf-8): the delete log that
                                                           peers pull (kvstore/node/tombstones.py);
                                                           an empty key = the whole tenant

Entry value, index format 2 (little-endian)::

    offset size  field
         0    8  segment id
         8    8  offset of the record in the segment
        16    4  shard bytes (the record header adds kvstore.store.segments.header_bytes(...))
        20    8  shard checksum (xxh3-64 from the shard header)
        28    8  created_s      (f64): when the version was written (newest version wins)
        36    8  last_access_s  (f64)
        44    8  expires_at_s   (f64, inf = never)
        52    1  record format of the segment record (1 or 2, kvstore/store/segments.py)
        53    1  shard index (from the shard header)
        54    1  traffic class length c
        55    c  traffic class (ascii)
      55+c    .  tenant (utf-8): compared on every lookup, so two tenants whose hashes
                 collide still never see each other's shards

Index format 1 had no record format, shard index or ``by_group``; start-up migrates such an
index in place (kvstore/store/migration.py), and ``node/index_format`` says which one is on disk.

Writing the entry is the commit point of a put: the store appends and fsyncs the segment bytes
first, then commits the transaction that adds the entry. Derived figures (per-class blocks and
bytes, per-segment live bytes, used bytes) change only inside :meth:`IndexWriter.put_entry`,
:meth:`IndexWriter.delete_entry` and the segment methods, in the same transaction, so they never
drift from the entries. A write, a re-put and a persisted read refresh all go through
:meth:`IndexWriter.put_entry`, so the ``access`` order follows every access the store records.

Disk space (lmdb only, :class:`LmdbBackend`): the index never writes into a page the filesystem
has not allocated. lmdb maps its files; a page of a sparse file that a full disk cannot back
kills the process with SIGBUS (seen on a full tmpfs: lock.mdb's reader table). So ``lock.mdb`` is
allocated whole at open, and ``data.mdb`` is kept allocated ``reserve_bytes`` ahead of lmdb's
last page (``posix_fallocate``): the index's own writes land in space the node already holds,
puts are refused (CapacityExhausted) once that reserve cannot be kept, and deletes, expiry and
eviction still commit from what is left. The allocated size counts inside the node's byte limit.
"""

from __future__ import annotations

import bisect
import errno
import logging
import math
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import lmdb
import xxhash

from kvstore.errors import CapacityExhausted, IndexUnusable
from kvstore.store.segments import RECORD_FORMAT, header_bytes

log = logging.getLogger(__name__)

DBS = (
    "entries",
    "expiry",
    "access",
    "by_seg",
    "by_group",
    "segments",
    "quarantined",
    "deleted",
    "deleted_time",
    "tombstones",
    "erase",
    "counters",
)
ENTRY_KEY_BYTES = 40
_ENTRY = struct.Struct("<QQIQdddBBB")
_ENTRY_V1 = struct.Struct("<QQIQdddB")
_SEGMENT = struct.Struct("<qQQQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct("<d")
_MAX_U64 = (1 << 64) - 1
USED_BYTES = "node/used_bytes"
NEXT_SEGMENT_ID = "node/next_segment_id"
LAST_TOMBSTONE_SEQ = "node/last_tombstone_seq"
_TOMBSTONE = struct.Struct("<dB")
INDEX_FORMAT = "node/index_format"  # absent = 1 (entries without record format or shard index)
CURRENT_INDEX_FORMAT = 2
RETIRED_VERSIONS = "node/retired_versions"  # older versions dropped when a newer one committed
DEFAULT_RESERVE_BYTES = 32 << 20
# Page-level lmdb failures that mean the file is damaged, not that a request was wrong.
_CORRUPT_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)


def class_counter(traffic_class: str, name: str) -> str:
    """Counter name of a per-class figure, e.g. ``class/chat/hits``."""
    return f"class/{traffic_class}/{name}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored shard: who owns it, where its record is, and its TTL state."""

    tenant: str
    key: bytes
    version: bytes
    traffic_class: str
    segment_id: int
    offset: int
    shard_bytes: int
    shard_checksum: int
    created_s: float
    last_access_s: float
    expires_at_s: float
    shard_index: int = 0
    record_format: int = RECORD_FORMAT

    @property
    def index_key(self) -> bytes:
        return entry_key(self.tenant, self.key, self.version)

    @property
    def header_bytes(self) -> int:
        return header_bytes(self.tenant, self.traffic_class, self.record_format)

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.shard_bytes

    @property
    def order(self) -> tuple[float, bytes]:
        """Which of two versions of a key is newer: the later write, then the larger version."""
        return (self.created_s, self.version)


@dataclass(frozen=True, slots=True)
class SegmentMeta:
    """A segment file as the index knows it: its window and how much of it is live."""

    segment_id: int
    window_id: int
    committed_bytes: int = 0
    live_bytes: int = 0
    num_live: int = 0

    @property
    def dead_bytes(self) -> int:
        return self.committed_bytes - self.live_bytes


@dataclass(frozen=True, slots=True)
class Tombstone:
    """One delete in the node's delete log: every version of ``key`` (``b""``: every key of
    the tenant) created at or before ``at_s`` is deleted."""

    seq: int
    tenant: str
    key: bytes
    at_s: float


def _encode_tombstone(t: Tombstone) -> bytes:
    return _TOMBSTONE.pack(t.at_s, len(t.key)) + t.key + t.tenant.encode()


def _decode_tombstone(seq_key: bytes, value: bytes) -> Tombstone:
    at_s, key_len = _TOMBSTONE.unpack_from(value)
    key_end = _TOMBSTONE.size + key_len
    return Tombstone(
        _U64.unpack(seq_key)[0], value[key_end:].decode(), value[_TOMBSTONE.size : key_end], at_s
    )


def tenant_hash(tenant: str) -> bytes:
    return xxhash.xxh3_64_digest(tenant.encode())


def entry_key(tenant: str, key: bytes, version: bytes) -> bytes:
    return tenant_hash(tenant) + key + version


def _u64(value: int) -> bytes:
    return _U64.pack(value)


def _prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no such key)."""
    value = int.from_bytes(prefix, "big") + 1
    return None if value >> (8 * len(prefix)) else value.to_bytes(len(prefix), "big")


def _time_prefix(time_s: float) -> bytes:
    """Order-preserving 8 bytes for a time; inf sorts last (never expires, never evicted)."""
    if math.isinf(time_s):
        return _u64(_MAX_U64)
    return _u64(min(max(int(time_s * 1e6), 0), _MAX_U64 - 1))


def _access_key(entry: Entry) -> bytes | None:
    """The entry's key in the ``access`` order; None for one that never expires (never evicted)."""
    if math.isinf(entry.expires_at_s):
        return None
    return _time_prefix(entry.last_access_s) + entry.index_key


def encode_entry(entry: Entry) -> bytes:
    cls = entry.traffic_class.encode()
    fixed = _ENTRY.pack(
        entry.segment_id,
        entry.offset,
        entry.shard_bytes,
        entry.shard_checksum,
        entry.created_s,
        entry.last_access_s,
        entry.expires_at_s,
        entry.record_format,
        entry.shard_index,
        len(cls),
    )
    return fixed + cls + entry.tenant.encode()


def decode_entry(index_key: bytes, value: bytes) -> Entry:
    *fields, record_format, shard_index, cls_len = _ENTRY.unpack_from(value)
    return _decoded(index_key, value, _ENTRY.size, cls_len, fields, shard_index, record_format)


def decode_entry_v1(index_key: bytes, value: bytes) -> Entry:
    """An entry written by index format 1 (kvstore/store/migration.py); its records are format 1 and
    its shard index is unknown (0) until the migration reads it from the shard header."""
    *fields, cls_len = _ENTRY_V1.unpack_from(value)
    return _decoded(index_key, value, _ENTRY_V1.size, cls_len, fields, 0, 1)


def _decoded(
    index_key: bytes,
    value: bytes,
    fixed_bytes: int,
    cls_len: int,
    fields: list,
    shard_index: int,
    record_format: int,
) -> Entry:
    segment_id, offset, shard_bytes, checksum, created, last, expires = fields
    cls_end = fixed_bytes + cls_len
    return Entry(
        tenant=value[cls_end:].decode(),
        key=index_key[8:24],
        version=index_key[24:40],
        traffic_class=value[fixed_bytes:cls_end].decode(),
        segment_id=segment_id,
        offset=offset,
        shard_bytes=shard_bytes,
        shard_checksum=checksum,
        created_s=created,
        last_access_s=last,
        expires_at_s=expires,
        shard_index=shard_index,
        record_format=record_format,
    )


def _encode_segment(meta: SegmentMeta) -> bytes:
    return _SEGMENT.pack(meta.window_id, meta.committed_bytes, meta.live_bytes, meta.num_live)


def _decode_segment(key: bytes, value: bytes) -> SegmentMeta:
    return SegmentMeta(_U64.unpack(key)[0], *_SEGMENT.unpack(value))


class Txn(Protocol):
    """The backend's transaction: an ordered byte map per named sub-database."""

    def get(self, db: str, key: bytes) -> bytes | None: ...

    def put(self, db: str, key: bytes, value: bytes) -> None: ...

    def delete(self, db: str, key: bytes) -> None: ...

    def scan(
        self, db: str, start: bytes, stop: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` items with ``start <= key < stop`` (no stop: to the end), ascending."""
        ...


class Backend(Protocol):
    reserve_bytes: int  # write space kept allocated ahead (0: none needed)

    def begin(self, *, write: bool) -> AbstractContextManager[Txn]:
        """A transaction: commits when the block exits normally, aborts on an exception."""
        ...

    def allocated_bytes(self) -> int:
        """Disk bytes the backend holds (0 in memory)."""
        ...

    def ensure_reserve(self) -> bool:
        """Keep write space allocated ahead; False when the disk cannot give it."""
        ...

    def headroom_bytes(self) -> int:
        """Space allocated ahead that writes can still use."""
        ...

    def verify(self) -> None:
        """Read everything once; IndexUnusable if the backend is damaged."""
        ...

    def close(self) -> None: ...


class _LmdbTxn:
    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
        self.txn: lmdb.Transaction | None = txn  # None once the transaction ended
        self._dbs = dbs

    @property
    def _txn(self) -> lmdb.Transaction:
        assert self.txn is not None, "index view used after its transaction ended"
        return self.txn

    def get(self, db: str, key: bytes) -> bytes | None:
        return self._txn.get(key, db=self._dbs[db])

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self._txn.put(key, value, db=self._dbs[db])

    def delete(self, db: str, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs[db])

    def scan(
        self, db: str, start: bytes, stop: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        items: list[tuple[bytes, bytes]] = []
        cursor = self._txn.cursor(db=self._dbs[db])
        if not cursor.set_range(start):
            return items
        for key, value in cursor.iternext():
            if (stop is not None and key >= stop) or len(items) >= limit:
                break
            items.append((key, value))
        return items


class LmdbBackend:
    """lmdb environment under ``path``; ``sync`` = fsync on every commit (durability).

    ``reserve_bytes``: disk space kept allocated ahead of lmdb's last page (module docstring).
    The map itself is a large virtual reservation (``map_size_bytes``); only the file's
    allocated size costs disk. Raises IndexUnusable if the files are not a readable lmdb
    environment.
    """

    def __init__(
        self,
        path: Path,
        *,
        sync: bool,
        map_size_bytes: int = 1 << 40,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.reserve_bytes = reserve_bytes
        try:
            self._env = lmdb.open(
                str(path), map_size=map_size_bytes, max_dbs=len(DBS), sync=sync, readahead=False
            )
            self._dbs = {name: self._env.open_db(name.encode()) for name in DBS}
        except (*_CORRUPT_ERRORS, lmdb.VersionMismatchError) as exc:
            raise IndexUnusable(f"the index in {path} cannot be opened: {exc}") from exc
        _allocate_whole(path / "lock.mdb")  # the reader table is written through a mapping
        self._data_fd = os.open(path / "data.mdb", os.O_RDWR)
        self.ensure_reserve()

    @contextmanager
    def begin(self, *, write: bool) -> Iterator[Txn]:
        try:
            wrapper = _LmdbTxn(self._env.begin(write=write), self._dbs)
            try:
                with wrapper.txn:
                    yield wrapper
            finally:
                # py-lmdb frees a read txn's reader slot only when the Transaction object is
                # freed, and a view may outlive its block (an exception's traceback holds the
                # frames that used it: a failed put's). Enough of those filled lmdb's reader
                # table (MDB_READERS_FULL), so the wrapper lets go of the txn here.
                wrapper.txn = None
        except lmdb.MapFullError as exc:
            raise CapacityExhausted(
                f"the lmdb index is full ({exc}); raise its map size or free entries"
            ) from None
        except _CORRUPT_ERRORS as exc:
            raise IndexUnusable(f"the index in {self.path} is damaged: {exc}") from exc
        except lmdb.Error as exc:  # lmdb reports errno failures by their strerror text
            if not _disk_full(exc, self.path):
                raise
            raise CapacityExhausted(f"disk full while committing the index: {exc}") from exc

    def used_bytes(self) -> int:
        """Bytes of the data file up to lmdb's last page (what the index occupies)."""
        info, stat = self._env.info(), self._env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def allocated_bytes(self) -> int:
        """Disk bytes the index's files hold (its share of the node's byte limit)."""
        return sum(_allocated(self.path / name) for name in ("data.mdb", "lock.mdb"))

    def ensure_reserve(self) -> bool:
        """Keep the data file allocated ``reserve_bytes`` past lmdb's last page; False when the
        disk cannot give that much (then only the space left ahead remains for writes)."""
        want = self.used_bytes() + self.reserve_bytes
        if os.fstat(self._data_fd).st_size >= want - self.reserve_bytes // 2:
            return True
        try:
            os.posix_fallocate(self._data_fd, 0, want)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return False
        return True

    def headroom_bytes(self) -> int:
        """Allocated bytes past lmdb's last page: what index writes can still use."""
        return os.fstat(self._data_fd).st_size - self.used_bytes()

    def verify(self) -> None:
        """Read every page of every sub-database; IndexUnusable if any fails."""
        with self.begin(write=False) as txn:
            for name in DBS:
                start = b""
                while items := txn.scan(name, start, None, 4096):
                    start = items[-1][0] + b"\x00"

    def close(self) -> None:
        self._env.close()
        os.close(self._data_fd)


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _allocate_whole(path: Path) -> None:
    """Allocate every byte of an existing file (no holes for a mapping to fault on). On a disk
    already full that is not possible: the node starts anyway (a full disk must not keep it
    from serving reads) and says so, since more concurrent readers than the allocated part of
    the table holds could then fault."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, max(os.fstat(fd).st_size, 1))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.warning("disk full: %s could not be allocated whole (%s)", path, exc)
    finally:
        os.close(fd)


def _disk_full(exc: lmdb.Error, path: Path) -> bool:
    """Whether an lmdb write failure is the disk running out: ENOSPC, or the EIO lmdb reports
    for a short write, on a filesystem with (almost) nothing left."""
    text = str(exc)
    if os.strerror(errno.ENOSPC) in text:
        return True
    return os.strerror(errno.EIO) in text and shutil.disk_usage(path).free < 1 << 20


class _SortedMap:
    """A dict with its keys kept sorted, for range scans in the in-memory twin."""

    def __init__(self) -> None:
        self.items: dict[bytes, bytes] = {}
        self.keys: list[bytes] = []

    def put(self, key: bytes, value: bytes) -> None:
        if key not in self.items:
            bisect.insort(self.keys, key)
        self.items[key] = value

    def delete(self, key: bytes) -> None:
        if self.items.pop(key, None) is not None:
            del self.keys[bisect.bisect_left(self.keys, key)]


class _MemoryTxn:
    def __init__(self, maps: dict[str, _SortedMap], undo: list | None) -> None:
        self._maps = maps
        self._undo = undo  # None: read-only

    def get(self, db: str, key: bytes) -> bytes | None:
        return self._maps[db].items.get(key)

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self._record(db, key)
        self._maps[db].put(key, value)

    def delete(self, db: str, key: bytes) -> None:
        self._record(db, key)
        self._maps[db].delete(key)

    def scan(
        self, db: str, start: bytes, stop: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        smap = self._maps[db]
        first = bisect.bisect_left(smap.keys, start)
        last = len(smap.keys) if stop is None else bisect.bisect_left(smap.keys, stop)
        keys = smap.keys[first : min(last, first + limit)]
        return [(k, smap.items[k]) for k in keys]

    def _record(self, db: str, key: bytes) -> None:
        if self._undo is None:
            raise RuntimeError("write in a read-only transaction (open it with write=True)")
        self._undo.append((db, key, self._maps[db].items.get(key)))

    def rollback(self) -> None:
        for db, key, old in reversed(self._undo or []):
            if old is None:
                self._maps[db].delete(key)
            else:
                self._maps[db].put(key, old)


class MemoryBackend:
    """The in-memory twin of :class:`LmdbBackend`: same semantics, no durability.

    Transactions are serialized by one lock (a twin for tests and the simulator, not a server).
    """

    reserve_bytes = 0

    def __init__(self) -> None:
        self._maps = {name: _SortedMap() for name in DBS}
        self._lock = threading.RLock()

    @contextmanager
    def begin(self, *, write: bool) -> Iterator[Txn]:
        with self._lock:
            txn = _MemoryTxn(self._maps, [] if write else None)
            try:
                yield txn
            except BaseException:
                txn.rollback()
                raise

    def used_bytes(self) -> int:
        return 0

    def allocated_bytes(self) -> int:
        return 0

    def ensure_reserve(self) -> bool:
        return True

    def headroom_bytes(self) -> int:
        return 1 << 62

    def verify(self) -> None:
        return None

    def close(self) -> None:
        self._maps = {name: _SortedMap() for name in DBS}


class IndexView:
    """Queries over one transaction's snapshot."""

    def __init__(self, txn: Txn) -> None:
        self._txn = txn

    def versions(self, tenant: str, key: bytes) -> list[Entry]:
        """Every entry (all versions, expired or not) of ``key`` owned by ``tenant``."""
        prefix = tenant_hash(tenant) + key
        items = self._txn.scan("entries", prefix, _prefix_end(prefix), 1 << 16)
        entries = (decode_entry(k, v) for k, v in items)
        return [e for e in entries if e.tenant == tenant]

    def tenant_entries(self, tenant: str, start: bytes, limit: int) -> list[Entry]:
        """Up to ``limit`` entries of ``tenant`` from index key ``start`` (b"": the first)."""
        prefix = tenant_hash(tenant)
        items = self._txn.scan("entries", max(start, prefix), _prefix_end(prefix), limit)
        return [e for e in (decode_entry(k, v) for k, v in items) if e.tenant == tenant]

    def erase_queue(self, limit: int) -> list[tuple[int, int, int]]:
        """(segment id, offset, record bytes) of deleted records not yet destroyed on disk."""
        items = self._txn.scan("erase", b"", None, limit)
        return [(*struct.unpack(">QQ", k), _U64.unpack(v)[0]) for k, v in items]

    def tombstones(self, after_seq: int, limit: int) -> list[Tombstone]:
        """Up to ``limit`` delete-log records with a sequence number above ``after_seq``."""
        items = self._txn.scan("tombstones", _u64(after_seq + 1), None, limit)
        return [_decode_tombstone(k, v) for k, v in items]

    def newest(self, tenant: str, key: bytes) -> Entry | None:
        """The newest version of ``key`` held for ``tenant`` (expired or not), or None."""
        return max(self.versions(tenant, key), key=_order, default=None)

    def entry(self, tenant: str, key: bytes, version: bytes) -> Entry | None:
        value = self._txn.get("entries", entry_key(tenant, key, version))
        if value is None:
            return None
        found = decode_entry(entry_key(tenant, key, version), value)
        return found if found.tenant == tenant else None

    def by_expiry(self, before_s: float, limit: int) -> list[Entry]:
        """Entries with ``expires_at_s < before_s``, earliest expiry first."""
        stop = _time_prefix(before_s)
        items = self._txn.scan("expiry", b"", stop, limit)
        return [self._entry_at(k[8:]) for k, _ in items]

    def evictable_by_expiry(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """Up to ``limit`` (position, entry) of entries that can expire, earliest expiry first,
        from position ``start`` (b"": the first); the next scan resumes after a position at
        ``position + b"\\x00"``."""
        items = self._txn.scan("expiry", start, _time_prefix(math.inf), limit)
        return [(k, self._entry_at(k[8:])) for k, _ in items]

    def evictable_by_access(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """As :meth:`evictable_by_expiry`, least recently accessed first."""
        items = self._txn.scan("access", start, None, limit)
        return [(k, self._entry_at(k[8:])) for k, _ in items]

    def in_segment(self, segment_id: int, limit: int) -> list[Entry]:
        prefix = _u64(segment_id)
        items = self._txn.scan("by_seg", prefix, _u64(segment_id + 1), limit)
        return [self._entry_at(k[8:]) for k, _ in items]

    def by_segment(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """Up to ``limit`` (position, entry) in segment order from position ``start`` (b"": the
        first); the next scan resumes after a position at ``position + b"\\x00"``."""
        items = self._txn.scan("by_seg", start, None, limit)
        return [(k, self._entry_at(k[8:])) for k, _ in items]

    def by_group(self, group: int, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """Up to ``limit`` (position, entry) of one placement group's entries in key order
        (tenant hash, key, version) from position ``start`` (b"": the first); resume after a
        position at ``position + b"\\x00"``."""
        prefix = _U32.pack(group)
        items = self._txn.scan("by_group", max(start, prefix), _prefix_end(prefix), limit)
        return [(k, self._entry_at(k[4:])) for k, _ in items]

    def deleted_at(self, tenant: str, key: bytes, *, tenant_wide: bool = True) -> float | None:
        """When ``tenant`` last deleted ``key`` on this node, or purged itself
        (``tenant_wide``), as far as the delete log is kept; None if not."""
        th = tenant_hash(tenant)
        times = []
        for th_key in (th + key, th) if tenant_wide and key else (th + key,):
            value = self._txn.get("deleted", th_key)
            if value is not None and value[8:].decode() == tenant:
                times.append(_F64.unpack_from(value)[0])
        return max(times, default=None)

    def quarantined(self) -> dict[int, str]:
        """Segment id -> why its bytes go to quarantine/ instead of being deleted."""
        items = self._txn.scan("quarantined", b"", None, 1 << 40)
        return {_U64.unpack(k)[0]: v.decode() for k, v in items}

    def segments(self) -> list[SegmentMeta]:
        return [_decode_segment(k, v) for k, v in self._txn.scan("segments", b"", None, 1 << 40)]

    def segment(self, segment_id: int) -> SegmentMeta | None:
        value = self._txn.get("segments", _u64(segment_id))
        return None if value is None else _decode_segment(_u64(segment_id), value)

    def counter(self, name: str) -> float | None:
        value = self._txn.get("counters", name.encode())
        return None if value is None else _F64.unpack(value)[0]

    def counters(self) -> dict[str, float]:
        items = self._txn.scan("counters", b"", None, 1 << 40)
        return {k.decode(): _F64.unpack(v)[0] for k, v in items}

    def next_segment_id(self) -> int:
        """An id above every segment ever registered."""
        return int(self.counter(NEXT_SEGMENT_ID) or 1)

    def index_format(self) -> int:
        """The index format on disk: 1 for an index written before format 2 existed."""
        return int(self.counter(INDEX_FORMAT) or 1)

    def is_blank(self) -> bool:
        """True for an index nothing was ever written to (fresh, or lost and recreated)."""
        return not self._txn.scan("counters", b"", None, 1) and not self._txn.scan(
            "segments", b"", None, 1
        )

    def used_bytes(self) -> int:
        """Bytes held in segment files (live and dead records)."""
        return int(self.counter(USED_BYTES) or 0)

    def _entry_at(self, index_key: bytes) -> Entry:
        value = self._txn.get("entries", index_key)
        assert value is not None, f"secondary index names missing entry {index_key.hex()}"
        return decode_entry(index_key, value)


class IndexWriter(IndexView):
    """Mutations in one write transaction; derived figures are kept in step here.

    Segment records and counters change once per entry, so they are cached here and written
    to the transaction once, by :meth:`flush`, just before the commit.
    """

    def __init__(self, txn: Txn, group_of: Callable[[bytes], int]) -> None:
        super().__init__(txn)
        self._group_of = group_of
        self._segment_cache: dict[int, SegmentMeta | None] = {}  # None = deleted
        self._counter_cache: dict[str, float | None] = {}
        self._dirty_segments: set[int] = set()
        self._dirty_counters: set[str] = set()

    def segment(self, segment_id: int) -> SegmentMeta | None:
        if segment_id not in self._segment_cache:
            self._segment_cache[segment_id] = super().segment(segment_id)
        return self._segment_cache[segment_id]

    def segments(self) -> list[SegmentMeta]:
        merged = {m.segment_id: m for m in super().segments()}
        merged.update({sid: self._segment_cache[sid] for sid in self._dirty_segments})
        return [m for _, m in sorted(merged.items()) if m is not None]

    def counter(self, name: str) -> float | None:
        if name not in self._counter_cache:
            self._counter_cache[name] = super().counter(name)
        return self._counter_cache[name]

    def counters(self) -> dict[str, float]:
        merged = super().counters()
        merged.update({name: self._counter_cache[name] for name in self._dirty_counters})
        return merged

    def flush(self) -> None:
        """Write cached segment records and counters into the transaction."""
        for segment_id in self._dirty_segments:
            meta = self._segment_cache[segment_id]
            if meta is None:
                self._txn.delete("segments", _u64(segment_id))
            else:
                self._txn.put("segments", _u64(segment_id), _encode_segment(meta))
        for name in self._dirty_counters:
            self._txn.put("counters", name.encode(), _F64.pack(self._counter_cache[name]))
        self._dirty_segments.clear()
        self._dirty_counters.clear()

    def put_entry(self, entry: Entry) -> Entry | None:
        """Insert or replace ``entry`` (same tenant, key, version); return the replaced one."""
        old_value = self._txn.get("entries", entry.index_key)
        old = None if old_value is None else decode_entry(entry.index_key, old_value)
        if old is not None:
            self._unlink(old)
        self._txn.put("entries", entry.index_key, encode_entry(entry))
        self._txn.put("expiry", _time_prefix(entry.expires_at_s) + entry.index_key, b"")
        self._txn.put("by_seg", _u64(entry.segment_id) + entry.index_key, b"")
        self._txn.put("by_group", self._group_key(entry), b"")
        if (access_key := _access_key(entry)) is not None:
            self._txn.put("access", access_key, b"")
        self._account(entry, +1)
        return old

    def retire_older(self, entry: Entry) -> list[Entry]:
        """Delete the versions of ``entry``'s key older than it (a newer write committed)."""
        older = [
            e
            for e in self.versions(entry.tenant, entry.key)
            if e.version != entry.version and e.order < entry.order
        ]
        for old in older:
            self.delete_entry(old)
        self.add(RETIRED_VERSIONS, len(older))
        return older

    def mark_quarantined(self, segment_id: int, reason: str) -> None:
        """When this segment is freed, move its file to quarantine/ instead of deleting it."""
        self._txn.put("quarantined", _u64(segment_id), reason.encode())

    def unmark_quarantined(self, segment_id: int) -> None:
        self._txn.delete("quarantined", _u64(segment_id))

    def set_counter(self, name: str, value: float) -> None:
        self._set(name, value)

    def delete_entry(self, entry: Entry) -> bool:
        """Remove the entry stored under ``entry``'s key; False if there is none."""
        value = self._txn.get("entries", entry.index_key)
        if value is None:
            return False
        self._unlink(decode_entry(entry.index_key, value))
        self._txn.delete("entries", entry.index_key)
        return True

    def queue_erase(self, entry: Entry) -> None:
        """Remember that ``entry``'s record bytes must be destroyed on disk (same transaction
        as its delete, so a crash before the erase cannot forget it)."""
        self._txn.put(
            "erase", struct.pack(">QQ", entry.segment_id, entry.offset), _u64(entry.record_bytes)
        )

    def erased(self, segment_id: int, offset: int) -> None:
        self._txn.delete("erase", struct.pack(">QQ", segment_id, offset))

    def log_tombstone(self, tenant: str, key: bytes, at_s: float) -> int:
        """Append a record to the delete log (and note the delete by key); return its
        sequence number."""
        seq = int(self.counter(LAST_TOMBSTONE_SEQ) or 0) + 1
        self._txn.put("tombstones", _u64(seq), _encode_tombstone(Tombstone(seq, tenant, key, at_s)))
        self._set(LAST_TOMBSTONE_SEQ, seq)
        self.note_deleted(tenant, key, at_s)
        return seq

    def prune_tombstones(self, before_s: float, limit: int = 4096) -> int:
        """Drop delete-log records, and deletes noted by key, older than ``before_s``."""
        old = [t for t in self.tombstones(0, limit) if t.at_s < before_s]
        for tombstone in old:
            self._txn.delete("tombstones", _u64(tombstone.seq))
        for time_key, _ in self._txn.scan("deleted_time", b"", _time_prefix(before_s), limit):
            self._txn.delete("deleted_time", time_key)
            self._txn.delete("deleted", time_key[8:])
        return len(old)

    def note_deleted(self, tenant: str, key: bytes, at_s: float) -> None:
        """Remember, by key (``b""``: the whole tenant), that it was deleted at ``at_s``: a
        repair's shard of a version written at or before that is refused (the repair rule,
        kvstore/store/deletion.py)."""
        th_key = tenant_hash(tenant) + key
        previous = self.deleted_at(tenant, key, tenant_wide=False)
        if previous is not None:
            if previous >= at_s:
                return
            self._txn.delete("deleted_time", _time_prefix(previous) + th_key)
        self._txn.put("deleted", th_key, _F64.pack(at_s) + tenant.encode())
        self._txn.put("deleted_time", _time_prefix(at_s) + th_key, b"")

    def legacy_items(self, start: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        """Raw (index key, value) of ``entries`` from ``start`` (the migration decodes them)."""
        return self._txn.scan("entries", start, None, limit)

    def replace_legacy_entry(self, entry: Entry) -> None:
        """Store a format-1 entry in format 2 at the same key: its expiry and segment keys are
        unchanged; the group key, and the access key an old index may lack, are added."""
        self._txn.put("entries", entry.index_key, encode_entry(entry))
        self._txn.put("by_group", self._group_key(entry), b"")
        if (access_key := _access_key(entry)) is not None:
            self._txn.put("access", access_key, b"")

    def delete_legacy_entry(self, entry: Entry) -> None:
        """Remove a format-1 entry (decoded by the caller) and everything derived from it."""
        self._unlink(entry)
        self._txn.delete("entries", entry.index_key)

    def add_segment(self, segment_id: int, window_id: int) -> None:
        """Register a new, empty segment file; segment ids are never reused."""
        self._put_segment(SegmentMeta(segment_id, window_id))
        if segment_id >= self.next_segment_id():
            self._set(NEXT_SEGMENT_ID, segment_id + 1)

    def set_committed_bytes(self, segment_id: int, committed_bytes: int) -> None:
        meta = self.segment(segment_id)
        assert meta is not None, f"segment {segment_id} is not in the index"
        self.add(USED_BYTES, committed_bytes - meta.committed_bytes)
        self._put_segment(replace(meta, committed_bytes=committed_bytes))

    def delete_segment(self, segment_id: int) -> None:
        meta = self.segment(segment_id)
        assert meta is not None and meta.num_live == 0, f"segment {segment_id} still holds data"
        self.add(USED_BYTES, -meta.committed_bytes)
        self._segment_cache[segment_id] = None
        self._dirty_segments.add(segment_id)

    def add(self, name: str, delta: float) -> None:
        if delta:
            self._set(name, (self.counter(name) or 0.0) + delta)

    def set_min(self, name: str, value: float) -> None:
        current = self.counter(name)
        if current is None or value < current:
            self._set(name, value)

    def _set(self, name: str, value: float) -> None:
        self._counter_cache[name] = value
        self._dirty_counters.add(name)

    def _put_segment(self, meta: SegmentMeta) -> None:
        self._segment_cache[meta.segment_id] = meta
        self._dirty_segments.add(meta.segment_id)

    def _unlink(self, entry: Entry) -> None:
        self._txn.delete("expiry", _time_prefix(entry.expires_at_s) + entry.index_key)
        self._txn.delete("by_seg", _u64(entry.segment_id) + entry.index_key)
        self._txn.delete("by_group", self._group_key(entry))
        if (access_key := _access_key(entry)) is not None:
            self._txn.delete("access", access_key)
        self._account(entry, -1)

    def _group_key(self, entry: Entry) -> bytes:
        return _U32.pack(self._group_of(entry.key)) + entry.index_key

    def _account(self, entry: Entry, sign: int) -> None:
        self.add(class_counter(entry.traffic_class, "blocks"), sign)
        self.add(class_counter(entry.traffic_class, "bytes"), sign * entry.shard_bytes)
        meta = self.segment(entry.segment_id)
        assert meta is not None, f"entry {entry.index_key.hex()} names unknown segment"
        live_bytes = meta.live_bytes + sign * entry.record_bytes
        num_live = meta.num_live + sign
        self._put_segment(
            SegmentMeta(meta.segment_id, meta.window_id, meta.committed_bytes, live_bytes, num_live)
        )


def _no_groups(key: bytes) -> int:
    return 0


def _order(entry: Entry) -> tuple[float, bytes]:
    return entry.order


class Index:
    """The index of one node over a backend: ``with index.read() as view`` / ``index.write()``.

    ``group_of(key)`` names the placement group a key belongs to (``by_group``); a store that
    does not know the cluster's placement files everything under group 0.
    """

    def __init__(self, backend: Backend, group_of: Callable[[bytes], int] = _no_groups) -> None:
        self.backend = backend
        self.group_of = group_of

    @contextmanager
    def read(self) -> Iterator[IndexView]:
        with self.backend.begin(write=False) as txn:
            yield IndexView(txn)

    @contextmanager
    def write(self) -> Iterator[IndexWriter]:
        """One atomic transaction: all of its changes commit together or none do."""
        with self.backend.begin(write=True) as txn:
            writer = IndexWriter(txn, self.group_of)
            yield writer
            writer.flush()

    def verify(self) -> None:
        """Decode every entry, segment record and counter once (after reading every page);
        IndexUnusable if anything does not decode: values damaged inside intact pages."""
        self.backend.verify()
        try:
            with self.read() as view:
                decode = decode_entry if view.index_format() >= 2 else decode_entry_v1
                start = b""
                while items := view._txn.scan("entries", start, None, 4096):
                    for index_key, value in items:
                        decode(index_key, value)
                    start = items[-1][0] + b"\x00"
                view.segments()
                view.counters()
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise IndexUnusable(f"an index value does not decode: {exc}") from exc

    def close(self) -> None:
        self.backend.close()
