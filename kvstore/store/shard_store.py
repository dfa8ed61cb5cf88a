"""The synchronous shard store of one node: segments + index, TTL expiry and capacity eviction.

Pure of asyncio and gRPC; the clock is passed in. Thread-safe: reads run concurrently (an lmdb
read snapshot and a ``pread`` per shard), writes serialize on one lock (lmdb has one writer).
:class:`ShardStore` is the one public face; the work is done by one module per part:

    request_checks.py    input checks, before anything is touched
    group_commit.py      the write path: queued puts committed together, all or nothing
    segment_appender.py  records appended to the open segment of their expiry window,
                         fsynced, then their index entries committed (the commit point)
    shard_reader.py      the read path: live lookups, verified reads (header, checksum,
                         version); a failing shard is CORRUPT, never served
    read_state.py        what reads learn (TTL refreshes, hit/miss counts, corrupt
                         shards), persisted by the next write or tick
    reclaimer.py         expiry and carry-forward: whole segment files freed
    deletion.py          delete and purge that destroy the records' bytes on disk,
                         the delete log (tombstones) and peers' tombstones applied
    eviction.py          the byte limit, eviction in the configured order (LRU by
                         default, or earliest expiry) of whole blocks, compaction under
                         pressure
    compaction.py        background compaction of mostly dead segments (overwrites)
    recovery.py          start-up: data_dir lock, the index opened (damaged: moved
                         aside), rebuilt from segment records if lost
                         (index_rebuild.py) or migrated (migration.py),
                         segment files checked against it
    store_stats.py       figures per node and per traffic class, and how they count
    scrub.py             background scrub: every record re-read and verified, paced
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from erasure.config import CodecConfig
from kvstore.byte_arena import Region
from kvstore.config import NodeConfig, TTLConfig
from kvstore.errors import CapacityExhausted, IndexUnusable, InvalidArgument, UnknownTrafficClass
from kvstore.store.compaction import Compactor
from kvstore.store.deletion import Deleter, Erased
from kvstore.store.eviction import Evictor
from kvstore.store.group_commit import GroupCommit, PutRequest
from kvstore.store.index import LAST_TOMBSTONE_SEQ, RETIRED_VERSIONS, Index
from kvstore.store.index_backends import DEFAULT_RESERVE_BYTES, Backend
from kvstore.store.index_codec import Entry, Tombstone
from kvstore.store.migration import rewrite_legacy_segments
from kvstore.store.read_state import ReadState
from kvstore.store.reclaimer import Reclaimer
from kvstore.store.recovery import lock_data_dir, move_index_aside, open_index, recover
from kvstore.store.request_checks import (
    ShardIndexOf,
    check_keys,
    check_put,
    check_tenant,
    check_version,
)
from kvstore.store.scrub import Scrubber, ScrubStep
from kvstore.store.segment_appender import INF_WINDOW, SegmentAppender, window_end_s, window_id
from kvstore.store.segments import SegmentFiles
from kvstore.store.shard_reader import BatchRead, GetResult, ShardReader, Status
from kvstore.store.store_stats import ClassStats, StoreStats, empty_stats, store_stats
from kvstore.wire.landing import PoolLanding
from ttl.clock import Clock
from ttl.policy import Retention

log = logging.getLogger(__name__)

MIN_RESERVE_BYTES = 64 << 10
LEGACY_SEGMENTS_PER_TICK = 2
# How far (real seconds) a put's version write time may run ahead of this node's clock. A time
# further ahead would order the version above every later overwrite and outlive deletes made
# before it (a tombstone deletes the versions written at or before it); NTP keeps clocks far
# closer than this.
MAX_WRITE_AHEAD_S = 60.0

__all__ = [
    "INF_WINDOW",
    "BatchRead",
    "ClassStats",
    "Erased",
    "GetResult",
    "ShardStore",
    "Status",
    "StoreStats",
    "Tombstone",
    "empty_stats",
    "window_end_s",
    "window_id",
]


@dataclass(frozen=True)
class PutResult:
    """What a put did: shards stored new, and shards left out on purpose."""

    num_stored: int
    num_superseded: int = 0  # a newer version of the key is held: the shard is not needed
    num_fenced: int = 0  # a repair's shard of a key deleted after its version was written


@dataclass(frozen=True)
class PutOptions:
    """How a put stores its shards (clients set ``written_at_s``; repairs set all three).

    ``written_at_s``: each shard's version write time, which orders versions (one per shard,
    0 = the node's now; empty = all now). ``expires_at_s``: keep this expiry instead of a fresh
    TTL (0 = the class TTL from now). ``repair``: a repair's write, whose shards are refused for
    keys this node deleted at or after their version was written (kvstore/store/deletion.py).
    ``ttl_s``: the block's own TTL, used instead of its class's (and its tenant's cap) when
    shorter; 0 = none. Like every TTL it counts from the last access (read_state.entry_ttl_s).
    """

    written_at_s: Sequence[float] = ()
    expires_at_s: float = 0.0
    repair: bool = False
    ttl_s: float = 0.0


_DROP_BATCH = 512
MOVED_AWAY_SHARDS = "node/moved_away_shards"  # dropped after a map change moved them away


def reserve_bytes_for(node: NodeConfig, data_dir: Path) -> int:
    """The index's reserved space: ``index_reserve_bytes``, or 1/32 of the node's limit (the
    configured one, else the disk), between 64 KiB and 32 MiB."""
    if node.index_reserve_bytes:
        return node.index_reserve_bytes
    data_dir.mkdir(parents=True, exist_ok=True)
    limit = node.max_bytes or shutil.disk_usage(data_dir).total
    return max(MIN_RESERVE_BYTES, min(DEFAULT_RESERVE_BYTES, limit // 32))


class ShardStore:
    """Durable shard storage of one node (see the module docstring).

    ``group_of`` (key -> placement group) files entries for the repair's listing;
    ``shard_index_of`` (key -> the shard index this node holds, None if none) and ``codec``
    make puts that do not fit the cluster's map or code fail with INVALID_ARGUMENT.
    """

    def __init__(
        self,
        node: NodeConfig,
        ttl: TTLConfig,
        clock: Clock,
        backend: Backend | None = None,
        *,
        group_of: Callable[[bytes], int] | None = None,
        shard_index_of: ShardIndexOf | None = None,
        codec: CodecConfig | None = None,
    ) -> None:
        data_dir = Path(node.data_dir)
        self.node = node
        self.ttl = ttl
        self.clock = clock
        self._codec = codec
        self._shard_index_of = shard_index_of
        self._lock_fd = lock_data_dir(data_dir)
        self._files = SegmentFiles(data_dir / "segments", fsync=node.fsync)
        try:
            self._index, next_segment_id = self._open_index(data_dir, backend, group_of)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._write_lock = threading.Lock()
        self.retention = Retention(ttl.classes)
        self._reads = ReadState(lambda: self.retention, ttl.refresh_granularity_s)
        self._reader = ShardReader(self._index, self._files, self._reads)
        self._appender = SegmentAppender(
            self._index,
            self._files,
            expiry_window_s=ttl.expiry_window_s,
            segment_max_bytes=node.segment_max_bytes,
            next_segment_id=next_segment_id,
        )
        self._reclaimer = Reclaimer(
            self._index, self._files, self._appender, self._reader, self._reads, ttl.expiry_window_s
        )
        self._deleter = Deleter(self._index, self._files)
        self._evictor = Evictor(
            node,
            self._index,
            self._files,
            self._reclaimer,
            ttl.eviction,
            self._deleter.erase_queued,
        )
        self._puts = GroupCommit(
            self._index, self._appender, self._evictor, self._reads, lambda: self.retention
        )
        self._compactor = Compactor(self._index, self._reclaimer)
        self._scrubber = Scrubber(self._index, self._reader, self._reads)
        with self._write_lock:
            self._deleter.erase_queued()  # deletes committed before a crash reach the bytes

    def _open_index(
        self,
        data_dir: Path,
        backend: Backend | None,
        group_of: Callable[[bytes], int] | None,
    ) -> tuple[Index, int]:
        """The recovered index and the next segment id (kvstore/store/recovery.py); an index that
        opens but fails to decode is moved aside and rebuilt."""
        path = data_dir / "index"
        options = {
            "sync": self.node.fsync,
            "reserve_bytes": reserve_bytes_for(self.node, data_dir),
            "group_of": group_of or (lambda key: 0),
        }
        for attempt in range(2):
            index = open_index(path, backend=backend, **options)
            try:
                return index, self._recover(index)
            except IndexUnusable as exc:
                index.close()
                if backend is not None or attempt:
                    raise
                move_index_aside(path, str(exc))
        raise AssertionError("unreachable")

    def _recover(self, index: Index) -> int:
        return recover(
            index, self._files, self.ttl.classes, self.ttl.expiry_window_s, self.clock.now()
        )

    def put(
        self,
        tenant: str,
        traffic_class: str,
        shards: Sequence[tuple[bytes, bytes]],
        options: PutOptions = PutOptions(),
    ) -> PutResult:
        """Store ``(key, shard)`` pairs durably, all or nothing (see :class:`PutResult`).

        Re-putting a key and version already held refreshes its TTL and is not counted; a
        new version retires the key's older versions in the same commit.
        """
        written_at_s = options.written_at_s or [0.0] * len(shards)
        if len(written_at_s) != len(shards):
            raise InvalidArgument(
                f"{len(written_at_s)} write times for {len(shards)} shards; give one per shard"
            )
        ahead_s = max(written_at_s, default=0.0) - self.clock.now()
        if ahead_s > MAX_WRITE_AHEAD_S * self.ttl.time_scale:
            raise InvalidArgument(
                f"a shard's written_at_s is {ahead_s / self.ttl.time_scale:.0f} s ahead of node "
                f"{self.node.id}'s clock (at most {MAX_WRITE_AHEAD_S:.0f} s); sync the clocks "
                "(NTP)"
            )
        items = check_put(
            self.node,
            self.ttl.classes,
            tenant,
            traffic_class,
            [(key, shard, at) for (key, shard), at in zip(shards, written_at_s, strict=True)],
            self._codec,
            self._shard_index_of,
        )
        request = PutRequest(
            tenant,
            traffic_class,
            items,
            self.clock.now(),
            expires_at_s=options.expires_at_s,
            repair=options.repair,
            ttl_s=options.ttl_s,
        )
        self._puts.enqueue(request)
        with self._write_lock:
            if not request.done:  # else an earlier lock holder committed it with its own
                self._puts.commit_queued()
        if request.error is not None:
            raise request.error
        return PutResult(request.num_stored, request.num_superseded, request.num_fenced)

    def get(
        self,
        tenant: str,
        keys: Sequence[bytes],
        version: bytes = b"",
        *,
        max_reply_bytes: int | None = None,
    ) -> list[GetResult]:
        """The newest live version's shard of each key (or ``version``'s), one result per key.

        A key asked for several times is looked up and read once. The bytes to read are known
        from the index before any is read: a request whose reply would pass
        ``max_reply_bytes`` gets InvalidArgument having read nothing. A hit refreshes the TTL
        of the returned shard; a corrupt shard is never returned.
        """
        check_tenant(tenant)
        check_keys(keys)
        check_version(version)
        keys = [bytes(key) for key in keys]
        now = self.clock.now()
        key_to_plan = {key: self._reader.plan(tenant, key, version, now) for key in set(keys)}
        reply_bytes = sum(key_to_plan[key].read_bytes for key in keys)
        if max_reply_bytes is not None and reply_bytes > max_reply_bytes:
            raise InvalidArgument(
                f"reply of {reply_bytes} bytes for {len(keys)} keys ({len(key_to_plan)} "
                f"distinct) exceeds max_batch_bytes {max_reply_bytes}; ask for fewer keys per "
                "request"
            )
        key_to_result = {
            key: self._reader.read(tenant, key, version, plan, now)
            for key, plan in key_to_plan.items()
        }
        return [key_to_result[key] for key in keys]

    def read_batch(
        self,
        tenant: str,
        keys: Sequence[bytes],
        version: bytes,
        take: Callable[[int], Region],
        *,
        max_reply_bytes: int | None = None,
        shared: bool = False,
        pool: PoolLanding | None = None,
    ) -> BatchRead:
        """:meth:`get` for a batch read: the answer's table entries, payloads read into one
        region from ``take`` (kvstore/wire/batch_answer.py has the layout). Same semantics: the
        newest version only, a key named twice read once, the reply size checked against
        ``max_reply_bytes`` before any byte is read; a hit refreshes the TTL of the shard
        served; a corrupt shard is never served. ``shared``: the region is a local client's
        memory; ``pool``: its landing pool's places (ShardReader.read_batch)."""
        check_tenant(tenant)
        check_keys(keys)
        check_version(version)
        return self._reader.read_batch(
            tenant, keys, version, self.clock.now(), take, max_reply_bytes, shared=shared, pool=pool
        )

    def contains(self, tenant: str, keys: Sequence[bytes]) -> list[list[bytes]]:
        """Live versions of each key, newest first; reads no data and refreshes nothing."""
        check_tenant(tenant)
        check_keys(keys)
        return self._reader.live_versions(tenant, keys, self.clock.now())

    def inspect(self, tenant: str, keys: Sequence[bytes]) -> list[list[tuple[Entry, bool]]]:
        """Each key's live entries, newest first, each with whether its bytes on disk pass
        every check now (read and verified as the scrub does: no TTL refresh, no hit or miss
        counted; a failing shard is handled as a read would handle it)."""
        check_tenant(tenant)
        check_keys(keys)
        now = self.clock.now()
        found = []
        for key in keys:
            live, _ = self._reader.live_entries(tenant, bytes(key), now)
            found.append([(e, ok) for e in live if (ok := self._verified(e)) is not None])
        return found

    def _verified(self, entry: Entry) -> bool | None:
        """Whether the entry's shard passes its checks; None if it went meanwhile."""
        try:
            return self._reader.read_verified(entry) is not None
        except FileNotFoundError:  # its segment was freed since the lookup (moved, expired)
            return None

    def touch(self, tenant: str, keys: Sequence[bytes], versions: Sequence[bytes] = ()) -> int:
        """Refresh the TTL of each key's newest live version (or of ``versions[i]``, the one
        the client read), as a read hit would, without reading bytes or counting a hit;
        return how many entries were refreshed."""
        check_tenant(tenant)
        check_keys(keys)
        if versions and len(versions) != len(keys):
            raise InvalidArgument(
                f"touch got {len(versions)} versions for {len(keys)} keys; send one per key or none"
            )
        for version in versions:
            check_version(version)
        now = self.clock.now()
        wanted = {
            bytes(k): bytes(v) for k, v in zip(keys, versions or [b""] * len(keys), strict=True)
        }
        plans = [self._reader.plan(tenant, k, v, now) for k, v in wanted.items()]
        refreshed = [plan.to_read[0] for plan in plans if plan.to_read]
        self._reads.record_touch(refreshed, now)
        return len(refreshed)

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Remove every version of ``keys`` owned by ``tenant``; return the number removed.

        The records' bytes are destroyed on disk before this returns (kvstore/store/deletion.py),
        and each key goes into the delete log that peers pull; a repair's shard of a version
        written before the delete is refused here from then on.
        """
        check_tenant(tenant)
        check_keys(keys)
        with self._write_lock:
            self._reads.flush(self._index)
            return self._deleter.delete(tenant, keys, self.clock.now()).num_shards

    def purge(self, tenant: str) -> Erased:
        """Remove every shard of ``tenant`` (bytes destroyed on disk) and log the purge."""
        check_tenant(tenant)
        with self._write_lock:
            self._reads.flush(self._index)
            return self._deleter.purge(tenant, self.clock.now())

    def apply_tombstones(self, tombstones: Iterable[Tombstone]) -> Erased:
        """Apply deletes a peer logged (see kvstore/store/deletion.py)."""
        with self._write_lock:
            self._reads.flush(self._index)
            return self._deleter.apply(tombstones)

    def tombstones(self, after_seq: int, limit: int) -> tuple[list[Tombstone], int]:
        """(delete-log records after ``after_seq``, the log's last sequence number)."""
        with self._index.read() as view:
            return view.tombstones(after_seq, limit), int(view.counter(LAST_TOMBSTONE_SEQ) or 0)

    def counter(self, name: str) -> float | None:
        """A persisted counter (kvstore/store/index.py), e.g. a peer's delete-log cursor."""
        with self._index.read() as view:
            return view.counter(name)

    def set_counter(self, name: str, value: float) -> None:
        with self._write_lock, self._index.write() as w:
            w.add(name, value - (w.counter(name) or 0.0))

    def set_retention_caps(self, tenant_to_max_ttl_s: Mapping[str, Mapping[str, float]]) -> None:
        """Install per-tenant TTL caps; entries stored under a looser TTL are cut back now."""
        retention = Retention(self.ttl.classes, tenant_to_max_ttl_s)
        if retention == self.retention:
            return
        with self._write_lock:
            self._reads.flush(self._index)
            self.retention = retention
            for tenant in tenant_to_max_ttl_s:
                self._cap_entries(tenant)

    def _cap_entries(self, tenant: str) -> None:
        start = b""
        while True:
            with self._index.write() as w:
                batch = w.tenant_entries(tenant, start, 4096)
                for entry in batch:
                    capped_s = self._capped_expiry_s(entry)
                    if capped_s < entry.expires_at_s:
                        w.put_entry(replace(entry, expires_at_s=capped_s))
            if len(batch) < 4096:
                return
            start = batch[-1].index_key + b"\x00"

    def _capped_expiry_s(self, entry: Entry) -> float:
        try:
            return self.retention.expires_at_s(
                entry.tenant, entry.traffic_class, entry.last_access_s
            )
        except UnknownTrafficClass:
            return entry.expires_at_s

    def list_group(self, group: int, start_after: bytes, limit: int) -> tuple[list[Entry], bytes]:
        """Up to ``limit`` entries of one placement group in key order after position
        ``start_after`` (b"": from the first), expired ones included; and the position to
        resume after (b"" once the group is done)."""
        with self._index.read() as view:
            start = start_after + b"\x00" if start_after else b""
            batch = view.by_group(group, start, limit)
        entries = [self._reads.with_refresh(e) for _, e in batch]
        return entries, (batch[-1][0] if len(batch) == limit else b"")

    def drop_moved(self, group_to_position: Mapping[int, int], num_groups: int) -> int:
        """Delete, on this node only (no tombstone, nothing sent to peers), the shards a
        settled cluster map no longer places here: entries of groups this node left, or of
        another position than its own. Only called once the move that placed them elsewhere
        was verified and finished (kvstore/node/map_keeper.py); return how many were dropped."""
        num_dropped = 0
        for group in range(num_groups):
            keep = group_to_position.get(group)
            start = b""
            while True:
                with self._write_lock, self._index.write() as w:
                    items = w.by_group(group, start, _DROP_BATCH)
                    moved = [e for _, e in items if e.shard_index != keep]
                    for entry in moved:
                        w.delete_entry(entry)
                    w.add(MOVED_AWAY_SHARDS, len(moved))
                num_dropped += len(moved)
                if len(items) < _DROP_BATCH:
                    break
                start = items[-1][0] + b"\x00"
        if num_dropped:
            with self._write_lock:
                self._reclaimer.free_empty_segments()
        return num_dropped

    def expire(self) -> int:
        """Delete expired entries, retire passed windows, free empty segments; return #expired."""
        now = self.clock.now()
        with self._write_lock:
            self._reads.flush(self._index)
            num_expired = self._reclaimer.expire(now)
            self._reclaimer.retire_windows(now)
            self._reclaimer.free_empty_segments()
        return num_expired

    def tick(self) -> int:
        """Periodic upkeep: persist refreshes, expire, evict if above the high watermark,
        compact mostly dead segments, erase what a failed erase left queued, prune the delete
        log, keep the index's reserve, and rewrite a few segments of the old record format."""
        num_expired = self.expire()
        now = self.clock.now()
        with self._write_lock:
            self._evictor.evict_if_over_high_watermark(now)
            self._compactor.step()
            self._deleter.erase_queued()
            self._deleter.prune_log(now - self.node.tombstone_retention_s)
            self._index.backend.ensure_reserve()
            rewrite_legacy_segments(self._index, self._reclaimer, LEGACY_SEGMENTS_PER_TICK)
        return num_expired

    def flush(self) -> None:
        """Persist read-side state (TTL refreshes, hit/miss counts, corrupt shards) now."""
        with self._write_lock:
            self._reads.flush(self._index)

    def scrub(self, max_bytes: int) -> ScrubStep:
        """Verify the next records of the background scrub's pass (see kvstore/store/scrub.py).

        Corrupt records are reported as a read reports them; nothing is refreshed or counted
        as a hit or miss. Runs concurrently with reads and writes.
        """
        return self._scrubber.step(max_bytes, self.clock.now(), time.time())

    def capacity_bytes(self) -> int:
        """The byte limit: configured, or the disk's free space plus what segments use."""
        return self._evictor.capacity_bytes()

    def held_bytes(self) -> int:
        """Disk space segment data holds: what the watermarks apply to (store/eviction.py)."""
        return self._evictor.held_bytes()

    def stats(self) -> StoreStats:
        """Figures per node and per traffic class, including not yet persisted counts."""
        with self._index.read() as view:
            counters = Counter(view.counters())
            segments = view.segments()
        counters.update(self._reads.pending_counters())
        return store_stats(
            counters,
            self.ttl.classes.names,
            num_segments=len(segments),
            capacity_bytes=self.capacity_bytes(),
            scrub=self._scrubber.progress,
            index_bytes=self._index.backend.allocated_bytes(),
            quarantined_bytes=self._files.quarantined_bytes(),
            retired_versions=int(counters[RETIRED_VERSIONS]),
            dead_bytes=sum(m.dead_bytes for m in segments),
            dead_bytes_free=self._files.punches_holes,
        )

    def close(self) -> None:
        """Persist pending state (if the disk still takes it) and close files and the index."""
        self._scrubber.close()
        with self._write_lock:
            try:
                self._reads.flush(self._index)
            except (CapacityExhausted, IndexUnusable) as exc:
                log.error("read refreshes and counts not persisted at close: %s", exc)
            self._files.close()
            self._index.close()
            os.close(self._lock_fd)
