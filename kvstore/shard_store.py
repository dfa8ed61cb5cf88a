"""The synchronous shard store of one node: segments + index, TTL expiry and capacity eviction.

Pure of asyncio and gRPC; the clock is passed in. Thread-safe: reads run concurrently (an lmdb
read snapshot and a ``pread`` per shard), writes serialize on one lock (lmdb has one writer).

Write path (a put request is all-or-nothing)::

    validate every shard (key size, class, size, verify_shard)  -> InvalidArgument, nothing done
    make room (expire, then evict by earliest expiry)           -> CapacityExhausted if impossible
    append records to the open segment of each shard's expiry window, fsync each segment once
    commit one index transaction with every new entry           <- the commit point
    (any failure before the commit truncates the appended bytes: nothing becomes visible)

Segments are grouped by expiry window (``TTLConfig.expiry_window_s``): a shard goes to the open
segment of the window its ``expires_at_s`` falls in. Expiry is a range scan of the index's
expiry order up to ``now`` (it never touches live entries), after which a segment whose window
has passed holds only entries refreshed by read hits. Those are *carried forward*: copied into
the segment of their new window, then the old file is deleted whole. We carry forward rather
than rewrite on every hit so reads stay read-only and cheap: a hit costs one small index update
(batched, see below), and only the few refreshed blocks of a passing window are ever copied.

Read hits refresh the TTL in memory first and are persisted in one index transaction by the
next write or the background tick (at least once a second on a node), so concurrent reads never
queue behind the single lmdb writer. A crash can lose refreshes younger than that: those blocks
then expire counting from their previous access. Expired entries are never served: every read
and contains checks ``expires_at_s`` against ``now`` before reclamation catches up.

Capacity: the byte limit is ``NodeConfig.max_bytes`` or, if 0, the disk's free space plus what
the segments already use. When a put would pass ``high_watermark`` of it, the store expires,
then evicts entries in ``EvictionOrder.EXPIRY`` order (earliest expiry first; within a class
that is least recently accessed first) until usage is under ``low_watermark``. Evicting an entry
leaves dead bytes in its segment; segments with no live entry are deleted, and segments holding
dead bytes are compacted (live records carried forward, most dead bytes first) until usage is
under the target. Entries of classes with an infinite TTL are never evicted: a put fails with
CapacityExhausted only when the space is held by them or by the request itself.

Counting: a get of a key counts one hit (under the class of the shards served) or one miss.
Every miss counts for the node; it also counts for a class when the key has entries of that
class that could not be served (expired or corrupt). A key the node does not hold (or not in
the requested version) has no class: it is only in the node's miss count.

Integrity: every read checks the record header (right key and tenant at that offset), the shard
checksum and the version against the index. A shard that fails is reported CORRUPT, counted,
never served, and removed from the index by the next write so a repair can store it again.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import math
import os
import shutil
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from erasure.shard import HEADER_BYTES, VERSION_BYTES, verify_shard
from kvstore.config import KEY_BYTES, NodeConfig, TTLConfig
from kvstore.errors import CapacityExhausted, ChecksumMismatch, CodecError, InvalidArgument
from kvstore.index import (
    USED_BYTES,
    Backend,
    Entry,
    Index,
    IndexView,
    IndexWriter,
    LmdbBackend,
    SegmentMeta,
    class_counter,
    tenant_hash,
)
from kvstore.segments import SegmentFiles, pack_record_header, record_bytes
from ttl.clock import Clock
from ttl.policy import EvictionOrder, is_expired

log = logging.getLogger(__name__)

MAX_KEYS_PER_REQUEST = 1 << 16
MAX_TENANT_CHARS = 256
INF_WINDOW = 1 << 62  # window of shards that never expire: never retired
CORRUPT_SHARDS = "node/corrupt_shards"
NODE_MISSES = "node/misses"  # every miss, including keys with no known class
_SCAN_BATCH = 4096
SHARD_CHECKSUM_SLICE = slice(HEADER_BYTES - 8, HEADER_BYTES)  # erasure/shard.py header layout
# The store's eviction policy; the simulator uses the same object (ttl/policy.py).
EVICTION_ORDER = EvictionOrder.EXPIRY
assert EVICTION_ORDER.priority(0.0, 1.0) == 1.0, "the expiry index orders by expires_at_s"


class Status(enum.IntEnum):
    """Per-key outcome of a get; the numbers match the wire's ShardStatus."""

    MISS = 0
    HIT = 1
    CORRUPT = 2


@dataclass(frozen=True)
class GetResult:
    status: Status
    shards: tuple[bytes, ...] = ()  # one per version held, newest first (HIT only)


@dataclass(frozen=True)
class ClassStats:
    traffic_class: str
    blocks: int
    bytes: int
    hits: int
    misses: int
    expired: int
    evicted: int
    youngest_evicted_age_s: float  # smallest now - last_access_s among evicted; -1 = none


@dataclass(frozen=True)
class StoreStats:
    num_shards: int
    shard_bytes: int  # bytes of live shards
    used_bytes: int  # bytes of segment files (live + dead records)
    capacity_bytes: int
    num_segments: int
    corrupt_shards: int
    hits: int
    misses: int  # includes keys of no known class
    classes: tuple[ClassStats, ...]


@dataclass
class _PutRequest:
    """A validated put waiting for the group commit that stores it (or fails it)."""

    tenant: str
    traffic_class: str
    items: list[tuple[bytes, bytes, bytes]]  # (key, version, shard)
    now: float
    done: bool = False
    num_stored: int = 0
    error: Exception | None = None


@dataclass
class _AppendPlan:
    """Segments written by one append batch: new ones and the end offset of each touched one."""

    new_segment_to_window: dict[int, int] = field(default_factory=dict)
    segment_to_end: dict[int, int] = field(default_factory=dict)
    window_to_open: dict[int, tuple[int, int]] = field(default_factory=dict)


def window_id(expires_at_s: float, expiry_window_s: float) -> int:
    """The expiry window an expiry time falls in (``INF_WINDOW`` for never)."""
    if math.isinf(expires_at_s):
        return INF_WINDOW
    return math.floor(expires_at_s / expiry_window_s)


def window_end_s(window: int, expiry_window_s: float) -> float:
    """When every shard originally placed in ``window`` has expired."""
    return math.inf if window == INF_WINDOW else (window + 1) * expiry_window_s


class ShardStore:
    """Durable shard storage of one node (see the module docstring)."""

    def __init__(
        self, node: NodeConfig, ttl: TTLConfig, clock: Clock, backend: Backend | None = None
    ) -> None:
        data_dir = Path(node.data_dir)
        self.node = node
        self.ttl = ttl
        self.clock = clock
        self._lock_fd = _lock_data_dir(data_dir)
        self._index = Index(backend or LmdbBackend(data_dir / "index", sync=node.fsync))
        self._files = SegmentFiles(data_dir / "segments", fsync=node.fsync)
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()  # guards the four buffers below
        self._refreshed: dict[bytes, tuple[Entry, float]] = {}  # index key -> (entry, hit time)
        self._pending_counts: Counter[str] = Counter()  # hits/misses not yet persisted
        self._corrupt: dict[bytes, Entry] = {}  # found by reads, removed by the next write
        self._put_queue: list[_PutRequest] = []  # puts waiting for the next group commit
        self._window_to_open: dict[int, tuple[int, int]] = {}  # -> (segment id, committed end)
        self._next_segment_id = 1
        self._recover()

    # ----- public API -------------------------------------------------------------------

    def put(self, tenant: str, traffic_class: str, shards: Sequence[tuple[bytes, bytes]]) -> int:
        """Store ``(key, shard)`` pairs durably, all or nothing; return how many were new.

        Re-putting a key and version already held refreshes its TTL and is not counted.
        """
        request = _PutRequest(
            tenant,
            traffic_class,
            self._validate_put(tenant, traffic_class, shards),
            self.clock.now(),
        )
        with self._state_lock:
            self._put_queue.append(request)
        with self._write_lock:
            if not request.done:  # else an earlier lock holder committed it with its own
                self._commit_queued_puts_locked()
        if request.error is not None:
            raise request.error
        return request.num_stored

    def get(self, tenant: str, keys: Sequence[bytes], version: bytes = b"") -> list[GetResult]:
        """Shards of each key (every live version, newest first, or only ``version``).

        A hit refreshes the TTL of each returned shard; a corrupt shard is never returned.
        """
        self._check_tenant(tenant)
        self._check_keys(keys)
        if version and len(version) != VERSION_BYTES:
            raise InvalidArgument(
                f"version must be {VERSION_BYTES} bytes (a shard header's block checksum) or "
                f"empty for every version, got {len(version)} bytes"
            )
        now = self.clock.now()
        return [self._get_one(tenant, key, version, now) for key in keys]

    def contains(self, tenant: str, keys: Sequence[bytes]) -> list[list[bytes]]:
        """Live versions of each key, newest first; reads no data and refreshes nothing."""
        self._check_tenant(tenant)
        self._check_keys(keys)
        now = self.clock.now()
        return [[e.version for e in self._live_entries(tenant, key, now)[0]] for key in keys]

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Remove every version of ``keys`` owned by ``tenant``; return the number removed."""
        self._check_tenant(tenant)
        self._check_keys(keys)
        with self._write_lock:
            self._flush_locked()
            with self._index.write() as w:
                victims = [e for key in keys for e in w.versions(tenant, key)]
                for entry in victims:
                    w.delete_entry(entry)
        return len(victims)

    def expire(self) -> int:
        """Delete expired entries, retire passed windows, free empty segments; return #expired."""
        now = self.clock.now()
        with self._write_lock:
            self._flush_locked()
            num_expired = self._expire_locked(now)
            self._retire_windows_locked(now)
            self._free_empty_segments_locked()
        return num_expired

    def tick(self) -> int:
        """Periodic upkeep: persist refreshes, expire, and evict if above the high watermark."""
        num_expired = self.expire()
        now = self.clock.now()
        with self._write_lock:
            limit = self.capacity_bytes()
            if self._used_bytes() > self.node.high_watermark * limit:
                self._evict_to_locked(self.node.low_watermark * limit, now)
        return num_expired

    def flush(self) -> None:
        """Persist read-side state (TTL refreshes, hit/miss counts, corrupt shards) now."""
        with self._write_lock:
            self._flush_locked()

    def capacity_bytes(self) -> int:
        """The byte limit: configured, or the disk's free space plus what segments use."""
        if self.node.max_bytes > 0:
            return self.node.max_bytes
        free = shutil.disk_usage(self._files.directory).free
        return free + self._used_bytes()

    def stats(self) -> StoreStats:
        """Figures per node and per traffic class, including not yet persisted counts."""
        with self._index.read() as view:
            counters = Counter(view.counters())
            num_segments = len(view.segments())
        with self._state_lock:
            counters.update(self._pending_counts)
            counters[CORRUPT_SHARDS] += len(self._corrupt)
        names = dict.fromkeys(self.ttl.classes.names)
        names.update(dict.fromkeys(_classes_in(counters)))
        classes = tuple(_class_stats(name, counters) for name in names)
        return StoreStats(
            num_shards=sum(c.blocks for c in classes),
            shard_bytes=sum(c.bytes for c in classes),
            used_bytes=int(counters[USED_BYTES]),
            capacity_bytes=self.capacity_bytes(),
            num_segments=num_segments,
            corrupt_shards=int(counters[CORRUPT_SHARDS]),
            hits=sum(c.hits for c in classes),
            misses=int(counters[NODE_MISSES]),
            classes=classes,
        )

    def close(self) -> None:
        """Persist pending state and close files and the index."""
        with self._write_lock:
            self._flush_locked()
            self._files.close()
            self._index.close()
            os.close(self._lock_fd)

    # ----- validation (pure) ------------------------------------------------------------

    def _validate_put(
        self, tenant: str, traffic_class: str, shards: Sequence[tuple[bytes, bytes]]
    ) -> list[tuple[bytes, bytes, bytes]]:
        """(key, version, shard) of a whole request checked before touching anything, deduped."""
        self._check_tenant(tenant)
        self.ttl.classes.check(traffic_class)
        self._check_keys([key for key, _ in shards])
        total_bytes = sum(len(shard) for _, shard in shards)
        if total_bytes > self.node.max_batch_bytes:
            raise InvalidArgument(
                f"put of {total_bytes} bytes exceeds max_batch_bytes "
                f"{self.node.max_batch_bytes}; split it into smaller requests"
            )
        unique: dict[tuple[bytes, bytes], bytes] = {}
        for key, shard in shards:
            unique[(bytes(key), self._check_shard(key, shard))] = shard
        return [(key, version, shard) for (key, version), shard in unique.items()]

    def _check_shard(self, key: bytes, shard: bytes) -> bytes:
        """The shard's version; InvalidArgument if oversized or malformed."""
        limit = self.node.max_shard_bytes + HEADER_BYTES
        if len(shard) > limit:
            raise InvalidArgument(
                f"shard of key {key.hex()} is {len(shard)} bytes; this node accepts at most "
                f"{limit} (max_shard_bytes + header); use a larger k or smaller blocks"
            )
        try:
            return verify_shard(shard).block_checksum
        except CodecError as exc:
            raise InvalidArgument(f"malformed shard for key {key.hex()}: {exc}") from None

    @staticmethod
    def _check_tenant(tenant: str) -> None:
        if not tenant or len(tenant) > MAX_TENANT_CHARS:
            raise InvalidArgument(
                f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters "
                f"(e.g. the account id), got {len(tenant)} characters"
            )

    @staticmethod
    def _check_keys(keys: Sequence[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgument(
                f"{len(keys)} keys in one request; at most {MAX_KEYS_PER_REQUEST}, split it"
            )
        for key in keys:
            if len(key) != KEY_BYTES:
                raise InvalidArgument(
                    f"keys must be {KEY_BYTES} bytes (xxh3-128 block keys), got {len(key)} "
                    f"bytes: {bytes(key[:32]).hex()}"
                )

    # ----- read path --------------------------------------------------------------------

    def _get_one(self, tenant: str, key: bytes, version: bytes, now: float) -> GetResult:
        try:
            found = self._read_live(tenant, key, version, now)
        except FileNotFoundError:  # a segment moved or was deleted under us: look once more
            try:
                found = self._read_live(tenant, key, version, now)
            except FileNotFoundError:
                found = ([], [], [])
        return self._record_get(*found, now)

    def _read_live(
        self, tenant: str, key: bytes, version: bytes, now: float
    ) -> tuple[list[Entry], list[bytes | None], list[Entry]]:
        """(live entries, their shard bytes or None if corrupt, expired entries)."""
        live, expired = self._live_entries(tenant, key, now)
        live = [e for e in live if not version or e.version == version]
        return live, [self._read_verified(e) for e in live], expired

    def _record_get(
        self, live: list[Entry], shards: list[bytes | None], expired: list[Entry], now: float
    ) -> GetResult:
        hits = [(e, s) for e, s in zip(live, shards, strict=True) if s is not None]
        with self._state_lock:
            if hits:
                for entry, _ in hits:
                    self._refreshed[entry.index_key] = (entry, now)
                self._pending_counts[class_counter(hits[0][0].traffic_class, "hits")] += 1
                return GetResult(Status.HIT, tuple(s for _, s in hits))
            self._pending_counts[NODE_MISSES] += 1
            for cls in {e.traffic_class for e in live + expired}:
                self._pending_counts[class_counter(cls, "misses")] += 1
        return GetResult(Status.CORRUPT if live else Status.MISS)

    def _live_entries(self, tenant: str, key: bytes, now: float) -> tuple[list[Entry], list[Entry]]:
        """(live entries newest first, expired entries) of a key, TTL refreshes applied.

        If anything looks expired the lookup is repeated on a fresh snapshot: a refresh may have
        been persisted (and dropped from memory) between our snapshot and our memory check.
        """
        for _ in range(2):
            with self._index.read() as view:
                entries = [self._with_refresh(e) for e in view.versions(tenant, key)]
            expired = [e for e in entries if is_expired(e.expires_at_s, now)]
            if not expired:
                break
        live = [e for e in entries if not is_expired(e.expires_at_s, now)]
        live.sort(key=lambda e: e.created_s, reverse=True)
        return live, expired

    def _with_refresh(self, entry: Entry) -> Entry:
        with self._state_lock:
            refreshed = self._refreshed.get(entry.index_key)
        if refreshed is None or refreshed[1] <= entry.last_access_s:
            return entry
        return self._touched(entry, refreshed[1])

    def _read_verified(self, entry: Entry) -> bytes | None:
        """The entry's shard bytes, or None (and remembered as corrupt) if they fail a check."""
        try:
            shard = self._files.read_shard(
                entry.segment_id,
                entry.offset,
                entry.shard_bytes,
                entry.key,
                tenant_hash(entry.tenant),
            )
            if verify_shard(shard).block_checksum != entry.version:
                raise ChecksumMismatch("shard version differs from the indexed version")
        except CodecError as exc:
            log.error("corrupt shard %s in segment %d: %s", entry.key.hex(), entry.segment_id, exc)
            with self._state_lock:
                self._corrupt[entry.index_key] = entry
            return None
        return shard

    # ----- write path (callers hold the write lock) -------------------------------------

    def _commit_queued_puts_locked(self) -> None:
        """Group commit: every queued put in one append, one fsync per segment, one txn.

        Concurrent puts wait on the write lock anyway; the first to get it stores them all,
        so N concurrent requests cost one round of fsyncs instead of N. Each request is still
        all or nothing: one refused for capacity fails alone; an I/O failure fails the group.
        """
        with self._state_lock:
            batch, self._put_queue = self._put_queue, []
        try:
            self._commit_batch_locked(batch)
        except Exception as exc:  # nothing of the batch was committed: every request fails
            for request in batch:
                request.error = request.error or exc
        finally:
            for request in batch:
                request.done = True

    def _commit_batch_locked(self, batch: list[_PutRequest]) -> None:
        self._flush_locked()
        appends: list[tuple[Entry, bytes]] = []
        refreshed: list[tuple[Entry, float]] = []
        for request in batch:
            try:
                self._plan_put(request, appends, refreshed)
            except CapacityExhausted as exc:
                request.error = exc
        self._append_and_commit(appends, refreshed)

    def _plan_put(
        self,
        request: _PutRequest,
        appends: list[tuple[Entry, bytes]],
        refreshed: list[tuple[Entry, float]],
    ) -> None:
        """Add ``request``'s new shards to ``appends`` and re-puts to ``refreshed``; make room.

        A re-put only refreshes the held entry. Should a later request of the group evict it
        before the commit, the refresh is skipped: the same as an eviction just after the put.
        """
        planned = {(e.tenant, e.key, e.version) for e, _ in appends}
        new_entries, touched = [], []
        with self._index.read() as view:
            for key, version, shard in request.items:
                held = view.entry(request.tenant, key, version)
                if (request.tenant, key, version) in planned:
                    continue  # stored by an earlier request of this group
                if held is None or is_expired(held.expires_at_s, request.now):
                    new_entries.append((self._new_entry(request, key, version, shard), shard))
                else:
                    touched.append((held, request.now))
        need_bytes = sum(record_bytes(e.shard_bytes) for e, _ in [*appends, *new_entries])
        self._make_room_locked(need_bytes, request.now)
        appends.extend(new_entries)
        refreshed.extend(touched)
        request.num_stored = len(new_entries)

    def _new_entry(self, request: _PutRequest, key: bytes, version: bytes, shard: bytes) -> Entry:
        """The entry of a new shard, not yet placed in a segment."""
        return Entry(
            tenant=request.tenant,
            key=key,
            version=version,
            traffic_class=request.traffic_class,
            segment_id=0,
            offset=0,
            shard_bytes=len(shard),
            shard_checksum=int.from_bytes(bytes(memoryview(shard)[SHARD_CHECKSUM_SLICE]), "little"),
            created_s=request.now,
            last_access_s=request.now,
            expires_at_s=self.ttl.classes.expires_at_s(request.traffic_class, request.now),
        )

    def _touched(self, entry: Entry, now: float) -> Entry:
        """``entry`` accessed at ``now``: its TTL restarts (kept if its class was removed)."""
        try:
            expires_at_s = self.ttl.classes.expires_at_s(entry.traffic_class, now)
        except InvalidArgument:
            return entry
        return replace(entry, last_access_s=now, expires_at_s=expires_at_s)

    def _append_and_commit(
        self,
        items: list[tuple[Entry, bytes]],
        refreshes: Sequence[tuple[Entry, float]] = (),
        also_drop: Sequence[Entry] = (),
    ) -> None:
        """Append records, fsync, then commit their entries in one transaction.

        ``refreshes`` ((entry, access time): re-puts) and ``also_drop`` (unreadable shards found
        while moving records) change in the same transaction.
        """
        plan = _AppendPlan(window_to_open=dict(self._window_to_open))
        try:
            placed = [self._append_one(plan, entry, shard) for entry, shard in items]
            self._files.sync(plan.segment_to_end)
            with self._index.write() as w:
                self._register(w, plan)
                for entry in placed:
                    w.put_entry(entry)
                self._persist_refreshes(w, refreshes)
                self._quarantine(w, also_drop)
        except BaseException:
            self._undo_appends(plan)
            raise
        self._install(plan)

    def _append_one(self, plan: _AppendPlan, entry: Entry, shard: bytes) -> Entry:
        window = window_id(entry.expires_at_s, self.ttl.expiry_window_s)
        size = record_bytes(len(shard))
        segment_id, end = plan.window_to_open.get(window, (0, 0))
        if segment_id == 0 or (end > 0 and end + size > self.node.segment_max_bytes):
            segment_id, end = self._next_segment_id, 0
            self._next_segment_id += 1
            plan.new_segment_to_window[segment_id] = window
        header = pack_record_header(entry.key, tenant_hash(entry.tenant), len(shard))
        self._files.append(segment_id, end, [header, shard])
        plan.window_to_open[window] = (segment_id, end + size)
        plan.segment_to_end[segment_id] = end + size
        return replace(entry, segment_id=segment_id, offset=end)

    @staticmethod
    def _register(w: IndexWriter, plan: _AppendPlan) -> None:
        for segment_id, window in plan.new_segment_to_window.items():
            w.add_segment(segment_id, window)
        for segment_id, end in plan.segment_to_end.items():
            w.set_committed_bytes(segment_id, end)

    def _undo_appends(self, plan: _AppendPlan) -> None:
        """Cut every touched segment back to its committed end: the put leaves no trace."""
        committed = {sid: end for sid, end in self._window_to_open.values()}
        for segment_id in plan.segment_to_end:
            if segment_id in plan.new_segment_to_window:
                self._files.remove(segment_id)
            else:
                with contextlib.suppress(OSError):
                    self._files.truncate(segment_id, committed[segment_id])

    def _install(self, plan: _AppendPlan) -> None:
        """After a commit: the plan's open segments become the store's; close sealed ones."""
        still_open = {sid for sid, _ in plan.window_to_open.values()}
        for segment_id, _ in self._window_to_open.values():
            if segment_id not in still_open:
                self._files.close_writer(segment_id)
        self._window_to_open = plan.window_to_open

    def _seal(self, segment_ids: Iterable[int]) -> None:
        """Stop appending to these segments (they are about to be moved out or deleted)."""
        doomed = set(segment_ids)
        self._window_to_open = {
            w: (sid, end) for w, (sid, end) in self._window_to_open.items() if sid not in doomed
        }
        for segment_id in doomed:
            self._files.close_writer(segment_id)

    def _flush_locked(self) -> None:
        """Persist TTL refreshes and counts from reads; drop shards found corrupt."""
        with self._state_lock:
            refreshed = dict(self._refreshed)
            counts = Counter(self._pending_counts)
            corrupt = dict(self._corrupt)
        if not (refreshed or counts or corrupt):
            return
        with self._index.write() as w:
            self._persist_refreshes(w, refreshed.values())
            for name, delta in counts.items():
                w.add(name, delta)
            self._quarantine(w, corrupt.values())
        with self._state_lock:
            for index_key, value in refreshed.items():
                if self._refreshed.get(index_key) == value:
                    del self._refreshed[index_key]
            self._pending_counts.subtract(counts)
            self._pending_counts = +self._pending_counts
            for index_key in corrupt:
                self._corrupt.pop(index_key, None)

    def _persist_refreshes(self, w: IndexWriter, refreshed: Iterable[tuple[Entry, float]]) -> None:
        for entry, hit_s in refreshed:
            held = w.entry(entry.tenant, entry.key, entry.version)
            if held is not None and held.last_access_s < hit_s:
                w.put_entry(self._touched(held, hit_s))

    @staticmethod
    def _quarantine(w: IndexWriter, corrupt: Iterable[Entry]) -> None:
        for entry in corrupt:
            held = w.entry(entry.tenant, entry.key, entry.version)
            if held is not None and (held.segment_id, held.offset) == (
                entry.segment_id,
                entry.offset,
            ):
                w.delete_entry(held)
                w.add(CORRUPT_SHARDS, 1)

    # ----- expiry, reclamation and eviction (callers hold the write lock) ---------------

    def _expire_locked(self, now: float) -> int:
        """Delete every expired entry: a range scan of the expiry order, live ones untouched."""
        num_expired = 0
        while True:
            with self._index.write() as w:
                batch = w.by_expiry(now + 1e-5, _SCAN_BATCH)
                expired = [e for e in batch if is_expired(e.expires_at_s, now)]
                for entry in expired:
                    w.delete_entry(entry)
                    w.add(class_counter(entry.traffic_class, "expired"), 1)
            num_expired += len(expired)
            if len(batch) < _SCAN_BATCH or len(expired) < len(batch):
                return num_expired

    def _retire_windows_locked(self, now: float) -> None:
        """Carry refreshed entries out of segments whose window has passed; delete those files."""
        with self._index.read() as view:
            passed = [
                m.segment_id
                for m in view.segments()
                if window_end_s(m.window_id, self.ttl.expiry_window_s) <= now
            ]
        if passed:
            self._move_out_locked(passed)

    def _free_empty_segments_locked(self) -> None:
        """Delete segments without a live entry (the whole file goes at once)."""
        with self._index.read() as view:
            empty = [m.segment_id for m in view.segments() if m.num_live == 0]
        self._seal(empty)
        with self._index.write() as w:
            for segment_id in empty:
                w.delete_segment(segment_id)
        for segment_id in empty:
            self._files.remove(segment_id)

    def _move_out_locked(self, segment_ids: list[int]) -> None:
        """Copy the live records of these segments into open segments, then delete them."""
        self._seal(segment_ids)
        for segment_id in segment_ids:
            while True:
                with self._index.read() as view:
                    batch = view.in_segment(segment_id, 256)
                if not batch:
                    break
                self._carry_forward(batch)
        self._free_empty_segments_locked()

    def _carry_forward(self, entries: list[Entry]) -> None:
        """Re-append ``entries`` (with their latest TTL refresh) to their current window."""
        moves, unreadable = [], []
        for entry in entries:
            try:
                shard = self._read_verified(entry)
            except FileNotFoundError:
                shard = None
            if shard is None:
                unreadable.append(entry)
            else:
                moves.append((self._with_refresh(entry), shard))
        self._append_and_commit(moves, also_drop=unreadable)
        with self._state_lock:
            for entry in unreadable:
                self._corrupt.pop(entry.index_key, None)

    def _used_bytes(self) -> int:
        with self._index.read() as view:
            return view.used_bytes()

    def _make_room_locked(self, need_bytes: int, now: float) -> None:
        """Evict so that ``need_bytes`` more fit under the high watermark, or raise."""
        limit = self.capacity_bytes()
        if self._used_bytes() + need_bytes <= self.node.high_watermark * limit:
            return
        self._evict_to_locked(self.node.low_watermark * limit - need_bytes, now)
        used = self._used_bytes()
        if used + need_bytes > limit:
            raise CapacityExhausted(
                f"node {self.node.id}: {need_bytes} more bytes do not fit: {used} of {limit} "
                "bytes are used by data that cannot be evicted (classes with an infinite TTL "
                "or this request); raise max_bytes, add disk or send smaller batches"
            )

    def _evict_to_locked(self, target_bytes: float, now: float) -> None:
        """Expire, then evict by the eviction order until usage is under ``target_bytes``."""
        self._expire_locked(now)
        while True:
            self._free_dead_space_locked(target_bytes)
            used = self._used_bytes()
            if used <= target_bytes or not self._evict_entries_locked(used - target_bytes, now):
                return

    def _evict_entries_locked(self, excess_bytes: float, now: float) -> int:
        """Evict entries in eviction order until their records add up to ``excess_bytes``."""
        freed_bytes, num_evicted = 0, 0
        with self._index.write() as w:
            while freed_bytes < excess_bytes:
                batch = w.by_expiry(math.inf, 64)
                for entry in batch:
                    self._evict_one(w, entry, now)
                    freed_bytes += entry.record_bytes
                    num_evicted += 1
                    if freed_bytes >= excess_bytes:
                        break
                if not batch:
                    break
        return num_evicted

    @staticmethod
    def _evict_one(w: IndexWriter, entry: Entry, now: float) -> None:
        w.delete_entry(entry)
        w.add(class_counter(entry.traffic_class, "evicted"), 1)
        w.set_min(
            class_counter(entry.traffic_class, "youngest_evicted_age_s"), now - entry.last_access_s
        )

    def _free_dead_space_locked(self, target_bytes: float) -> None:
        """Delete empty segments, then compact those with most dead bytes until under target."""
        self._free_empty_segments_locked()
        while self._used_bytes() > target_bytes:
            with self._index.read() as view:
                candidates = [m for m in view.segments() if m.dead_bytes > 0]
            if not candidates:
                return
            self._move_out_locked([max(candidates, key=_dead_bytes).segment_id])

    # ----- start-up ---------------------------------------------------------------------

    def _recover(self) -> None:
        """Check every segment against the index: cut torn tails, drop lost records, orphans."""
        with self._index.write() as w:
            metas = w.segments()
            for meta in metas:
                self._recover_segment(w, meta)
            self._next_segment_id = max(
                [w.next_segment_id(), *(sid + 1 for sid in self._files.ids_on_disk())]
            )
        orphans = self._files.ids_on_disk() - {m.segment_id for m in metas}
        for segment_id in sorted(orphans):
            log.warning("removing segment %d: never committed (crash during a put)", segment_id)
            self._files.remove(segment_id)
        log.info("recovered %d segments, %d bytes", len(metas), self._used_bytes())

    def _recover_segment(self, w: IndexWriter, meta: SegmentMeta) -> None:
        size = self._files.size(meta.segment_id) or 0
        if size > meta.committed_bytes:
            log.warning(
                "segment %d: truncating a torn tail of %d bytes",
                meta.segment_id,
                size - meta.committed_bytes,
            )
            self._files.truncate(meta.segment_id, meta.committed_bytes)
        elif size < meta.committed_bytes:
            self._drop_lost_records(w, meta, size)

    def _drop_lost_records(self, w: IndexWriter, meta: SegmentMeta, size: int) -> None:
        """The file is shorter than committed (lost on disk): entries past its end are gone."""
        lost = [e for e in _all_in_segment(w, meta.segment_id) if e.offset + e.record_bytes > size]
        log.error(
            "segment %d is %d bytes, %d were committed: %d shards lost",
            meta.segment_id,
            size,
            meta.committed_bytes,
            len(lost),
        )
        for entry in lost:
            w.delete_entry(entry)
            w.add(CORRUPT_SHARDS, 1)
        w.set_committed_bytes(meta.segment_id, size)


def _lock_data_dir(data_dir: Path) -> int:
    """Hold an exclusive lock on ``data_dir`` for this store's lifetime.

    A second process on the same directory would truncate the first one's in-flight appends
    as torn tails at its start-up; the lock makes it fail first instead.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InvalidArgument(
            f"data_dir {data_dir} is in use by another node process; "
            "give every node its own data_dir"
        ) from None
    return fd


def _all_in_segment(view: IndexView, segment_id: int) -> list[Entry]:
    return view.in_segment(segment_id, 1 << 40)


def _dead_bytes(meta: SegmentMeta) -> int:
    return meta.dead_bytes


def _classes_in(counters: Counter[str]) -> list[str]:
    return [name.split("/")[1] for name in counters if name.startswith("class/")]


def _class_stats(name: str, counters: Counter[str]) -> ClassStats:
    def get(figure: str) -> int:
        return int(counters[class_counter(name, figure)])

    youngest = class_counter(name, "youngest_evicted_age_s")
    return ClassStats(
        traffic_class=name,
        blocks=get("blocks"),
        bytes=get("bytes"),
        hits=get("hits"),
        misses=get("misses"),
        expired=get("expired"),
        evicted=get("evicted"),
        youngest_evicted_age_s=counters.get(youngest, -1.0),
    )
