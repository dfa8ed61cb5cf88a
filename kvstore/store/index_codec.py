"""The index's key and value encodings: pure functions of bytes, no backend, no clock, no I/O.

Sub-databases (:data:`DBS`) and their keys (``th`` = 8-byte tenant hash, integers big-endian so
byte order is numeric order)::

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
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import xxhash

from kvstore.store.segments import RECORD_FORMAT, header_bytes

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
_TOMBSTONE = struct.Struct("<dB")
U32_BE = struct.Struct(">I")  # placement group prefix of ``by_group``
U64_BE = struct.Struct(">Q")  # ids, offsets and times in keys: byte order is numeric order
F64 = struct.Struct("<d")  # counter values and delete times
_MAX_U64 = (1 << 64) - 1


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

    def placed(self, segment_id: int, offset: int) -> Entry:
        """This entry at another place (``dataclasses.replace`` costs 5x more per write)."""
        return Entry(
            self.tenant,
            self.key,
            self.version,
            self.traffic_class,
            segment_id,
            offset,
            self.shard_bytes,
            self.shard_checksum,
            self.created_s,
            self.last_access_s,
            self.expires_at_s,
            self.shard_index,
            self.record_format,
        )

    def accessed(self, last_access_s: float, expires_at_s: float) -> Entry:
        """This entry with a new TTL state (a read's refresh: once per shard served)."""
        return Entry(
            self.tenant,
            self.key,
            self.version,
            self.traffic_class,
            self.segment_id,
            self.offset,
            self.shard_bytes,
            self.shard_checksum,
            self.created_s,
            last_access_s,
            expires_at_s,
            self.shard_index,
            self.record_format,
        )


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


def encode_tombstone(t: Tombstone) -> bytes:
    return _TOMBSTONE.pack(t.at_s, len(t.key)) + t.key + t.tenant.encode()


def decode_tombstone(seq_key: bytes, value: bytes) -> Tombstone:
    at_s, key_len = _TOMBSTONE.unpack_from(value)
    key_end = _TOMBSTONE.size + key_len
    return Tombstone(
        U64_BE.unpack(seq_key)[0], value[key_end:].decode(), value[_TOMBSTONE.size : key_end], at_s
    )


@functools.lru_cache(maxsize=4096)
def tenant_hash(tenant: str) -> bytes:
    """The 8 bytes that stand for a tenant in index keys and record headers (cached: every
    read and write computes it for every key it touches)."""
    return xxhash.xxh3_64_digest(tenant.encode())


def entry_key(tenant: str, key: bytes, version: bytes) -> bytes:
    return tenant_hash(tenant) + key + version


def u64_key(value: int) -> bytes:
    """8 big-endian bytes: keys that sort in numeric order."""
    return U64_BE.pack(value)


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no such key)."""
    if prefix and prefix[-1] != 0xFF:  # the usual case: the last byte goes up by one
        return prefix[:-1] + bytes((prefix[-1] + 1,))
    value = int.from_bytes(prefix, "big") + 1
    return None if value >> (8 * len(prefix)) else value.to_bytes(len(prefix), "big")


def time_prefix(time_s: float) -> bytes:
    """Order-preserving 8 bytes for a time; inf sorts last (never expires, never evicted)."""
    if math.isinf(time_s):
        return u64_key(_MAX_U64)
    return u64_key(min(max(int(time_s * 1e6), 0), _MAX_U64 - 1))


def access_key(entry: Entry) -> bytes | None:
    """The entry's key in the ``access`` order; None for one that never expires (never evicted)."""
    if math.isinf(entry.expires_at_s):
        return None
    return time_prefix(entry.last_access_s) + entry.index_key


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


def encode_segment(meta: SegmentMeta) -> bytes:
    return _SEGMENT.pack(meta.window_id, meta.committed_bytes, meta.live_bytes, meta.num_live)


def decode_segment(key: bytes, value: bytes) -> SegmentMeta:
    return SegmentMeta(U64_BE.unpack(key)[0], *_SEGMENT.unpack(value))
