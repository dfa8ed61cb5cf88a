"""The synchronous shard store of one node: segments + index, TTL expiry and capacity eviction.

Pure of asyncio and gRPC; the clock is passed in. Thread-safe: reads run concurrently (an lmdb
read snapshot and a ``pread`` per shard), writes serialize on one lock (lmdb has one writer).
:class:`ShardStore` is the one public face; the work is done by one module per part:

    kvstore/request_checks.py    input checks, before anything is touched
    kvstore/group_commit.py      the write path: queued puts committed together, all or nothing
    kvstore/segment_appender.py  records appended to the open segment of their expiry window,
                                 fsynced, then their index entries committed (the commit point)
    kvstore/shard_reader.py      the read path: live lookups, verified reads (header, checksum,
                                 version); a failing shard is CORRUPT, never served
    kvstore/read_state.py        what reads learn (TTL refreshes, hit/miss counts, corrupt
                                 shards), persisted by the next write or tick
    kvstore/reclaimer.py         expiry and carry-forward: whole segment files freed
    kvstore/deletion.py          delete and purge that destroy the records' bytes on disk,
                                 the delete log (tombstones) and peers' tombstones applied
    kvstore/eviction.py          the byte limit, eviction in the configured order (LRU by
                                 default, or earliest expiry), compaction
    kvstore/recovery.py          start-up: data_dir lock, segment files checked against the index
    kvstore/store_stats.py       figures per node and per traffic class, and how they count
    kvstore/scrub.py             background scrub: every record re-read and verified, paced
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from kvstore.byte_arena import Region
from kvstore.config import NodeConfig, TTLConfig
from kvstore.deletion import Deleter, Erased
from kvstore.errors import UnknownTrafficClass
from kvstore.eviction import Evictor
from kvstore.group_commit import GroupCommit, PutRequest
from kvstore.index import LAST_TOMBSTONE_SEQ, Backend, Entry, Index, LmdbBackend, Tombstone
from kvstore.read_state import ReadState
from kvstore.reclaimer import Reclaimer
from kvstore.recovery import lock_data_dir, recover
from kvstore.request_checks import check_keys, check_put, check_tenant, check_version
from kvstore.scrub import Scrubber, ScrubStep
from kvstore.segment_appender import INF_WINDOW, SegmentAppender, window_end_s, window_id
from kvstore.segments import SegmentFiles
from kvstore.shard_reader import BatchRead, GetResult, ShardReader, Status
from kvstore.store_stats import ClassStats, StoreStats, store_stats
from ttl.clock import Clock
from ttl.policy import Retention

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
    "window_end_s",
    "window_id",
]


class ShardStore:
    """Durable shard storage of one node (see the module docstring)."""

    def __init__(
        self, node: NodeConfig, ttl: TTLConfig, clock: Clock, backend: Backend | None = None
    ) -> None:
        data_dir = Path(node.data_dir)
        self.node = node
        self.ttl = ttl
        self.clock = clock
        self._lock_fd = lock_data_dir(data_dir)
        self._index = Index(backend or LmdbBackend(data_dir / "index", sync=node.fsync))
        self._files = SegmentFiles(data_dir / "segments", fsync=node.fsync)
        self._write_lock = threading.Lock()
        self.retention = Retention(ttl.classes)
        self._reads = ReadState(lambda: self.retention)
        self._reader = ShardReader(self._index, self._files, self._reads)
        self._appender = SegmentAppender(
            self._index,
            self._files,
            expiry_window_s=ttl.expiry_window_s,
            segment_max_bytes=node.segment_max_bytes,
            next_segment_id=recover(self._index, self._files),
        )
        self._reclaimer = Reclaimer(
            self._index, self._files, self._appender, self._reader, self._reads, ttl.expiry_window_s
        )
        self._evictor = Evictor(node, self._index, self._files, self._reclaimer, ttl.eviction)
        self._puts = GroupCommit(
            self._index, self._appender, self._evictor, self._reads, lambda: self.retention
        )
        self._scrubber = Scrubber(self._index, self._reader, self._reads)
        self._deleter = Deleter(self._index, self._files)
        with self._write_lock:
            self._deleter.erase_queued()  # deletes committed before a crash reach the bytes

    def put(self, tenant: str, traffic_class: str, shards: Sequence[tuple[bytes, bytes]]) -> int:
        """Store ``(key, shard)`` pairs durably, all or nothing; return how many were new.

        Re-putting a key and version already held refreshes its TTL and is not counted.
        """
        items = check_put(self.node, self.ttl.classes, tenant, traffic_class, shards)
        request = PutRequest(tenant, traffic_class, items, self.clock.now())
        self._puts.enqueue(request)
        with self._write_lock:
            if not request.done:  # else an earlier lock holder committed it with its own
                self._puts.commit_queued()
        if request.error is not None:
            raise request.error
        return request.num_stored

    def get(self, tenant: str, keys: Sequence[bytes], version: bytes = b"") -> list[GetResult]:
        """Shards of each key (every live version, newest first, or only ``version``).

        A hit refreshes the TTL of each returned shard; a corrupt shard is never returned.
        """
        check_tenant(tenant)
        check_keys(keys)
        check_version(version)
        now = self.clock.now()
        return [self._reader.get_one(tenant, key, version, now) for key in keys]

    def read_batch(
        self, tenant: str, keys: Sequence[bytes], version: bytes, take: Callable[[int], Region]
    ) -> BatchRead:
        """:meth:`get` for a batch read: the answer's table entries, payloads read into one
        region from ``take`` (kvstore/batch_answer.py has the layout). Same semantics: a hit
        refreshes the TTL of each shard served; a corrupt shard is never served."""
        check_tenant(tenant)
        check_keys(keys)
        check_version(version)
        return self._reader.read_batch(tenant, keys, version, self.clock.now(), take)

    def contains(self, tenant: str, keys: Sequence[bytes]) -> list[list[bytes]]:
        """Live versions of each key, newest first; reads no data and refreshes nothing."""
        check_tenant(tenant)
        check_keys(keys)
        now = self.clock.now()
        return [[e.version for e in self._reader.live_entries(tenant, key, now)[0]] for key in keys]

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Remove every version of ``keys`` owned by ``tenant``; return the number removed.

        The records' bytes are destroyed on disk before this returns (kvstore/deletion.py),
        and each key goes into the delete log that peers pull.
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
        """Apply deletes a peer logged (see kvstore/deletion.py)."""
        with self._write_lock:
            self._reads.flush(self._index)
            return self._deleter.apply(tombstones)

    def tombstones(self, after_seq: int, limit: int) -> tuple[list[Tombstone], int]:
        """(delete-log records after ``after_seq``, the log's last sequence number)."""
        with self._index.read() as view:
            return view.tombstones(after_seq, limit), int(view.counter(LAST_TOMBSTONE_SEQ) or 0)

    def counter(self, name: str) -> float | None:
        """A persisted counter (kvstore/index.py), e.g. a peer's delete-log cursor."""
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
        erase what a failed erase left queued, prune the delete log."""
        num_expired = self.expire()
        now = self.clock.now()
        with self._write_lock:
            self._evictor.evict_if_over_high_watermark(now)
            self._deleter.erase_queued()
            self._deleter.prune_log(now - self.node.tombstone_retention_s)
        return num_expired

    def flush(self) -> None:
        """Persist read-side state (TTL refreshes, hit/miss counts, corrupt shards) now."""
        with self._write_lock:
            self._reads.flush(self._index)

    def scrub(self, max_bytes: int) -> ScrubStep:
        """Verify the next records of the background scrub's pass (see kvstore/scrub.py).

        Corrupt records are reported as a read reports them; nothing is refreshed or counted
        as a hit or miss. Runs concurrently with reads and writes.
        """
        return self._scrubber.step(max_bytes, self.clock.now(), time.time())

    def capacity_bytes(self) -> int:
        """The byte limit: configured, or the disk's free space plus what segments use."""
        return self._evictor.capacity_bytes()

    def stats(self) -> StoreStats:
        """Figures per node and per traffic class, including not yet persisted counts."""
        with self._index.read() as view:
            counters = Counter(view.counters())
            num_segments = len(view.segments())
        counters.update(self._reads.pending_counters())
        return store_stats(
            counters,
            self.ttl.classes.names,
            num_segments=num_segments,
            capacity_bytes=self.capacity_bytes(),
            scrub=self._scrubber.progress,
        )

    def close(self) -> None:
        """Persist pending state and close files and the index."""
        self._scrubber.close()
        with self._write_lock:
            self._reads.flush(self._index)
            self._files.close()
            self._index.close()
            os.close(self._lock_fd)
