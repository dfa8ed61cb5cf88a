"""The node's index: where every committed shard lives, when it expires, what each segment holds.

One :class:`Index` over a small ordered key-value backend with transactions
(kvstore/store/index_backends.py: lmdb on a node, a sorted in-memory twin for unit tests and the
simulator). The index logic (secondary indexes, derived counters) is written once here, over the
pure key and value encodings of kvstore/store/index_codec.py (the layout of every sub-database is
drawn there), so both backends behave identically and one test suite runs against both.

Writing the entry is the commit point of a put: the store appends and fsyncs the segment bytes
first, then commits the transaction that adds the entry. Derived figures (per-class blocks and
bytes, per-segment live bytes, used bytes) change only inside :meth:`IndexWriter.put_entry`,
:meth:`IndexWriter.delete_entry` and the segment methods, in the same transaction, so they never
drift from the entries. A write, a re-put and a persisted read refresh all go through
:meth:`IndexWriter.put_entry`, so the ``access`` order follows every access the store records.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from kvstore.errors import IndexUnusable
from kvstore.store.index_backends import Backend, Txn
from kvstore.store.index_codec import (
    F64,
    U32_BE,
    U64_BE,
    Entry,
    SegmentMeta,
    Tombstone,
    access_key,
    decode_entry,
    decode_entry_v1,
    decode_segment,
    decode_tombstone,
    encode_entry,
    encode_segment,
    encode_tombstone,
    entry_key,
    prefix_end,
    tenant_hash,
    time_prefix,
    u64_key,
)

USED_BYTES = "node/used_bytes"
NEXT_SEGMENT_ID = "node/next_segment_id"
LAST_TOMBSTONE_SEQ = "node/last_tombstone_seq"
U64_MAX = (1 << 64) - 1  # the largest delete-log sequence number (uint64 on the wire)
INDEX_FORMAT = "node/index_format"  # absent = 1 (entries without record format or shard index)
CURRENT_INDEX_FORMAT = 2
RETIRED_VERSIONS = "node/retired_versions"  # older versions dropped when a newer one committed
_ENTRY_DBS = ("entries", "expiry", "by_seg", "by_group", "access")  # an entry's rows


def class_counter(traffic_class: str, name: str) -> str:
    """Counter name of a per-class figure, e.g. ``class/chat/hits``."""
    return f"class/{traffic_class}/{name}"


class IndexView:
    """Queries over one transaction's snapshot."""

    def __init__(self, txn: Txn) -> None:
        self._txn = txn

    def versions(self, tenant: str, key: bytes) -> list[Entry]:
        """Every entry (all versions, expired or not) of ``key`` owned by ``tenant``."""
        return self.versions_of(tenant, [key])[0]

    def versions_of(self, tenant: str, keys: Sequence[bytes]) -> list[list[Entry]]:
        """:meth:`versions` of each key (a batch read's lookups: one call, no per-key
        generators)."""
        scan, owner = self._txn.scan, tenant_hash(tenant)
        found = []
        for key in keys:
            prefix = owner + key
            entries = [
                decode_entry(k, v) for k, v in scan("entries", prefix, prefix_end(prefix), 1 << 16)
            ]
            found.append([e for e in entries if e.tenant == tenant])
        return found

    def tenant_entries(self, tenant: str, start: bytes, limit: int) -> list[Entry]:
        """Up to ``limit`` entries of ``tenant`` from index key ``start`` (b"": the first)."""
        prefix = tenant_hash(tenant)
        items = self._txn.scan("entries", max(start, prefix), prefix_end(prefix), limit)
        return [e for e in (decode_entry(k, v) for k, v in items) if e.tenant == tenant]

    def erase_queue(self, limit: int) -> list[tuple[int, int, int]]:
        """(segment id, offset, record bytes) of deleted records not yet destroyed on disk."""
        items = self._txn.scan("erase", b"", None, limit)
        return [(*struct.unpack(">QQ", k), U64_BE.unpack(v)[0]) for k, v in items]

    def tombstones(self, after_seq: int, limit: int) -> list[Tombstone]:
        """Up to ``limit`` delete-log records with a sequence number above ``after_seq``."""
        if after_seq >= U64_MAX:  # no sequence number is above the largest one
            return []
        items = self._txn.scan("tombstones", u64_key(after_seq + 1), None, limit)
        return [decode_tombstone(k, v) for k, v in items]

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
        stop = time_prefix(before_s)
        items = self._txn.scan("expiry", b"", stop, limit)
        return [self._entry_at(k[8:]) for k, _ in items]

    def evictable_by_expiry(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """Up to ``limit`` (position, entry) of entries that can expire, earliest expiry first,
        from position ``start`` (b"": the first); the next scan resumes after a position at
        ``position + b"\\x00"``."""
        items = self._txn.scan("expiry", start, time_prefix(math.inf), limit)
        return [(k, self._entry_at(k[8:])) for k, _ in items]

    def evictable_by_access(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """As :meth:`evictable_by_expiry`, least recently accessed first."""
        items = self._txn.scan("access", start, None, limit)
        return [(k, self._entry_at(k[8:])) for k, _ in items]

    def in_segment(self, segment_id: int, limit: int) -> list[Entry]:
        prefix = u64_key(segment_id)
        items = self._txn.scan("by_seg", prefix, u64_key(segment_id + 1), limit)
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
        prefix = U32_BE.pack(group)
        items = self._txn.scan("by_group", max(start, prefix), prefix_end(prefix), limit)
        return [(k, self._entry_at(k[4:])) for k, _ in items]

    def deleted_at(self, tenant: str, key: bytes, *, tenant_wide: bool = True) -> float | None:
        """When ``tenant`` last deleted ``key`` on this node, or purged itself
        (``tenant_wide``), as far as the delete log is kept; None if not."""
        th = tenant_hash(tenant)
        times = []
        for th_key in (th + key, th) if tenant_wide and key else (th + key,):
            value = self._txn.get("deleted", th_key)
            if value is not None and value[8:].decode() == tenant:
                times.append(F64.unpack_from(value)[0])
        return max(times, default=None)

    def quarantined(self) -> dict[int, str]:
        """Segment id -> why its bytes go to quarantine/ instead of being deleted."""
        items = self._txn.scan("quarantined", b"", None, 1 << 40)
        return {U64_BE.unpack(k)[0]: v.decode() for k, v in items}

    def segments(self) -> list[SegmentMeta]:
        return [decode_segment(k, v) for k, v in self._txn.scan("segments", b"", None, 1 << 40)]

    def segment(self, segment_id: int) -> SegmentMeta | None:
        value = self._txn.get("segments", u64_key(segment_id))
        return None if value is None else decode_segment(u64_key(segment_id), value)

    def counter(self, name: str) -> float | None:
        value = self._txn.get("counters", name.encode())
        return None if value is None else F64.unpack(value)[0]

    def counters(self) -> dict[str, float]:
        items = self._txn.scan("counters", b"", None, 1 << 40)
        return {k.decode(): F64.unpack(v)[0] for k, v in items}

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
                self._txn.delete("segments", u64_key(segment_id))
            else:
                self._txn.put("segments", u64_key(segment_id), encode_segment(meta))
        for name in self._dirty_counters:
            self._txn.put("counters", name.encode(), F64.pack(self._counter_cache[name]))
        self._dirty_segments.clear()
        self._dirty_counters.clear()

    def put_entry(self, entry: Entry) -> Entry | None:
        """Insert or replace ``entry`` (same tenant, key, version); return the replaced one."""
        return self.put_entries([entry])[0]

    def put_entries(self, entries: Sequence[Entry]) -> list[Entry | None]:
        """:meth:`put_entry` of each entry (distinct index keys), as one batch: each sub-database
        takes its rows in one call and the derived figures change once per class and segment
        (a group commit's hot path: no Python per row beyond building it). Returns the
        replaced entries."""
        index_keys = [entry.index_key for entry in entries]
        if len(set(index_keys)) != len(index_keys):
            raise ValueError("put_entries takes distinct entries; put repeated ones one by one")
        replaced = []
        for index_key in index_keys:
            old_value = self._txn.get("entries", index_key)
            old = None if old_value is None else decode_entry(index_key, old_value)
            if old is not None:
                self._unlink(old)
            replaced.append(old)
        rows: dict[str, list[tuple[bytes, bytes]]] = {db: [] for db in _ENTRY_DBS}
        for entry, index_key in zip(entries, index_keys, strict=True):
            rows["entries"].append((index_key, encode_entry(entry)))
            rows["expiry"].append((time_prefix(entry.expires_at_s) + index_key, b""))
            rows["by_seg"].append((u64_key(entry.segment_id) + index_key, b""))
            rows["by_group"].append((self._group_key(entry), b""))
            if (access := access_key(entry)) is not None:
                rows["access"].append((access, b""))
        for db, items in rows.items():
            if items:
                self._txn.put_many(db, items)
        self._account_many(entries, +1)
        return replaced

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
        self._txn.put("quarantined", u64_key(segment_id), reason.encode())

    def unmark_quarantined(self, segment_id: int) -> None:
        self._txn.delete("quarantined", u64_key(segment_id))

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
            "erase", struct.pack(">QQ", entry.segment_id, entry.offset), u64_key(entry.record_bytes)
        )

    def erased(self, segment_id: int, offset: int) -> None:
        self._txn.delete("erase", struct.pack(">QQ", segment_id, offset))

    def log_tombstone(self, tenant: str, key: bytes, at_s: float) -> int:
        """Append a record to the delete log (and note the delete by key); return its
        sequence number."""
        seq = int(self.counter(LAST_TOMBSTONE_SEQ) or 0) + 1
        self._txn.put(
            "tombstones", u64_key(seq), encode_tombstone(Tombstone(seq, tenant, key, at_s))
        )
        self._set(LAST_TOMBSTONE_SEQ, seq)
        self.note_deleted(tenant, key, at_s)
        return seq

    def prune_tombstones(self, before_s: float, limit: int = 4096) -> int:
        """Drop delete-log records, and deletes noted by key, older than ``before_s``."""
        old = [t for t in self.tombstones(0, limit) if t.at_s < before_s]
        for tombstone in old:
            self._txn.delete("tombstones", u64_key(tombstone.seq))
        for time_key, _ in self._txn.scan("deleted_time", b"", time_prefix(before_s), limit):
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
            self._txn.delete("deleted_time", time_prefix(previous) + th_key)
        self._txn.put("deleted", th_key, F64.pack(at_s) + tenant.encode())
        self._txn.put("deleted_time", time_prefix(at_s) + th_key, b"")

    def legacy_items(self, start: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        """Raw (index key, value) of ``entries`` from ``start`` (the migration decodes them)."""
        return self._txn.scan("entries", start, None, limit)

    def replace_legacy_entry(self, entry: Entry) -> None:
        """Store a format-1 entry in format 2 at the same key: its expiry and segment keys are
        unchanged; the group key, and the access key an old index may lack, are added."""
        self._txn.put("entries", entry.index_key, encode_entry(entry))
        self._txn.put("by_group", self._group_key(entry), b"")
        if (access := access_key(entry)) is not None:
            self._txn.put("access", access, b"")

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
        self._txn.delete("expiry", time_prefix(entry.expires_at_s) + entry.index_key)
        self._txn.delete("by_seg", u64_key(entry.segment_id) + entry.index_key)
        self._txn.delete("by_group", self._group_key(entry))
        if (access := access_key(entry)) is not None:
            self._txn.delete("access", access)
        self._account(entry, -1)

    def _group_key(self, entry: Entry) -> bytes:
        return U32_BE.pack(self._group_of(entry.key)) + entry.index_key

    def _account(self, entry: Entry, sign: int) -> None:
        self._account_many([entry], sign)

    def _account_many(self, entries: Sequence[Entry], sign: int) -> None:
        """Per-class blocks and bytes, per-segment live bytes and count, for entries added
        (``sign`` +1) or removed (-1)."""
        class_to_sums: dict[str, list[int]] = {}
        segment_to_sums: dict[int, list[int]] = {}
        for entry in entries:
            sums = class_to_sums.setdefault(entry.traffic_class, [0, 0])
            sums[0] += 1
            sums[1] += entry.shard_bytes
            sums = segment_to_sums.setdefault(entry.segment_id, [0, 0])
            sums[0] += 1
            sums[1] += entry.record_bytes
        for traffic_class, (num, num_bytes) in class_to_sums.items():
            self.add(class_counter(traffic_class, "blocks"), sign * num)
            self.add(class_counter(traffic_class, "bytes"), sign * num_bytes)
        for segment_id, (num, num_bytes) in segment_to_sums.items():
            meta = self.segment(segment_id)
            assert meta is not None, f"an entry names unknown segment {segment_id}"
            self._put_segment(
                SegmentMeta(
                    meta.segment_id,
                    meta.window_id,
                    meta.committed_bytes,
                    meta.live_bytes + sign * num_bytes,
                    meta.num_live + sign * num,
                )
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
