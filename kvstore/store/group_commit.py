"""The write path: puts queue up and the first to get the write lock commits them all at once.

A put request is all-or-nothing::

    check every shard (key size, class, size, verify_shard,     -> InvalidArgument, nothing done
      fits the cluster's code and this node's place)               (kvstore/store/request_checks.py)
    queue it; under the write lock take the whole queue:
      persist read-side state (refreshes, counts, corrupt shards)
      per request: new shards, re-puts, superseded shards (a      -> CapacityExhausted fails that
        newer version is held) and fenced repair shards (the key    request alone
        was deleted after the version was written); make room (expire,
        then evict in the configured order, sparing the group's
        re-puts)
      append every new record, fsync each segment once, commit   <- the commit point
        one index transaction (kvstore/store/segment_appender.py) that
        also retires the older versions of every key written
      (an unexpected failure fails every request of the group: none is left silently unstored)

Versions: a key's versions are ordered by their write time (``written_at_s``, the writer's
clock, the same on every shard of a version), then by the version bytes. A node keeps the
newest only: a write of a newer version retires the older ones in its commit, a write of an
older one is superseded (acknowledged, not stored). Every node that received both writes ends
with the same version, whatever order they arrived in, and overwrites never pile up.

Concurrent puts wait on the write lock anyway; the first to get it stores them all, so N
concurrent requests cost one round of fsyncs instead of N.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from erasure.shard import HEADER_BYTES, ShardHeader
from kvstore.errors import CapacityExhausted
from kvstore.store.eviction import Evictor
from kvstore.store.index import Index, IndexView, IndexWriter
from kvstore.store.index_codec import Entry
from kvstore.store.read_state import ReadState
from kvstore.store.segment_appender import SegmentAppender
from ttl.policy import Retention, is_expired

SHARD_CHECKSUM_SLICE = slice(HEADER_BYTES - 8, HEADER_BYTES)  # erasure/shard.py header layout


@dataclass
class PutRequest:
    """A checked put waiting for the group commit that stores it (or fails it).

    Each item carries its version's write time (0 = now). ``expires_at_s``: a repair's rebuilt
    shard keeps the block's expiry instead of a fresh TTL (0 = the class TTL from now).
    ``ttl_s``: the block's own TTL, used instead of the class TTL when shorter (0 = none).
    ``repair``: a repair's shard is dropped when this node deleted its key (or purged its
    tenant) at or after the version was written (the repair rule, kvstore/store/deletion.py).
    """

    tenant: str
    traffic_class: str
    # (key, header, shard, written_at_s)
    items: list[tuple[bytes, ShardHeader, bytes | memoryview, float]]
    now: float
    expires_at_s: float = 0.0
    repair: bool = False
    ttl_s: float = 0.0
    done: bool = False
    num_stored: int = 0
    num_superseded: int = 0
    num_fenced: int = 0
    error: Exception | None = None


class GroupCommit:
    """The queue of puts and the commit of a whole queue in one batch."""

    def __init__(
        self,
        index: Index,
        appender: SegmentAppender,
        evictor: Evictor,
        reads: ReadState,
        retention: Callable[[], Retention],
    ) -> None:
        self._index = index
        self._appender = appender
        self._evictor = evictor
        self._reads = reads
        self._retention = retention  # the store's current TTLs and tenant caps
        self._lock = threading.Lock()
        self._queue: list[PutRequest] = []  # puts waiting for the next group commit

    def enqueue(self, request: PutRequest) -> None:
        with self._lock:
            self._queue.append(request)

    def commit_queued(self) -> None:
        """Commit every queued put (caller holds the write lock); each request gets its result.

        Each request is still all or nothing: one refused for capacity fails alone; an I/O
        failure fails the group.
        """
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            self._commit_batch(batch)
        except Exception as exc:  # nothing of the batch was committed: every request fails
            for request in batch:
                request.error = request.error or exc
        finally:
            for request in batch:
                request.done = True

    def _commit_batch(self, batch: list[PutRequest]) -> None:
        self._reads.flush(self._index)
        if not self._index.backend.ensure_reserve() and self._index_reserve_short():
            raise CapacityExhausted(
                "disk full: the index cannot keep its reserved space; the node evicts to make "
                "room (reads and deletes still work)"
            )
        plan = _GroupPlan()
        for request in batch:
            try:
                self._plan_put(request, plan)
            except CapacityExhausted as exc:
                request.error = exc
                request.num_stored = 0

        def also(w: IndexWriter) -> None:
            self._reads.persist_refreshes(w, plan.refreshed)
            for entry, written_at_s in plan.rewritten:
                held = w.entry(entry.tenant, entry.key, entry.version)
                if held is not None and held.created_s < written_at_s:
                    w.put_entry(replace(held, created_s=written_at_s))
            for entry, _ in plan.appends:
                if plan.may_retire(entry):
                    w.retire_older(entry)

        self._appender.append_and_commit(plan.appends, also=also)

    def _plan_put(self, request: PutRequest, plan: _GroupPlan) -> None:
        """Add ``request``'s new shards to ``plan.appends`` and re-puts to ``plan.refreshed``;
        make room.

        A re-put only refreshes the held entry (at the commit), taking the re-put's write
        time when that is later. Making room never evicts an
        entry the group re-puts: the re-put is an access, and the put reports it stored.
        """
        new_entries: list[tuple[Entry, bytes | memoryview]] = []
        touched: list[tuple[Entry, float]] = []
        expires_at_s, last_access_s = self._expiry(request)
        with self._index.read() as view:
            for key, header, shard, written_at_s in request.items:
                if (request.tenant, key, header.block_checksum) in plan.planned:
                    continue  # stored by an earlier request of this group
                if self._fenced(view, request, key, written_at_s):
                    request.num_fenced += 1
                    continue
                entry = Entry(
                    request.tenant,
                    key,
                    header.block_checksum,
                    request.traffic_class,
                    0,  # segment and offset: placed by the appender
                    0,
                    len(shard),
                    _shard_checksum(shard),
                    written_at_s or request.now,
                    _last_access_s(request, last_access_s, written_at_s),
                    expires_at_s,
                    header.index,
                )
                held = view.versions(request.tenant, key)
                if held:
                    plan.held_keys.add((request.tenant, key))
                _plan_shard(held, request, entry, shard, new_entries, touched, plan.rewritten)
        need_bytes = plan.append_bytes + sum(e.record_bytes for e, _ in new_entries)
        keep = {e.index_key for e, _ in [*plan.refreshed, *touched]}
        self._evictor.make_room(need_bytes, request.now, keep)
        for entry, shard in new_entries:
            plan.add(entry, shard)
        plan.refreshed.extend(touched)
        request.num_stored = len(new_entries)

    def _expiry(self, request: PutRequest) -> tuple[float, float]:
        """(expires_at_s, last_access_s) of the request's new shards."""
        retention = self._retention()
        ttl_s = retention.ttl_s(request.tenant, request.traffic_class)
        if request.ttl_s > 0:  # the put's own TTL, never beyond the class's or the cap
            ttl_s = min(ttl_s, request.ttl_s)
        if request.expires_at_s > 0:  # a repair: the block's expiry, within the tenant's cap
            expires_at_s = min(request.expires_at_s, request.now + ttl_s)
            return expires_at_s, request.now if math.isinf(ttl_s) else expires_at_s - ttl_s
        expires_at_s = retention.expires_at_s(request.tenant, request.traffic_class, request.now)
        if request.ttl_s > 0:
            expires_at_s = min(expires_at_s, request.now + ttl_s)
        return expires_at_s, request.now

    def _index_reserve_short(self) -> bool:
        backend = self._index.backend
        return backend.headroom_bytes() < backend.reserve_bytes // 4

    @staticmethod
    def _fenced(view: IndexView, request: PutRequest, key: bytes, written_at_s: float) -> bool:
        if not request.repair:
            return False
        deleted_at_s = view.deleted_at(request.tenant, key)
        return deleted_at_s is not None and deleted_at_s >= written_at_s


@dataclass
class _GroupPlan:
    """What one group commit writes: new records, refreshed re-puts, re-puts written later."""

    appends: list[tuple[Entry, bytes | memoryview]] = field(default_factory=list)
    refreshed: list[tuple[Entry, float]] = field(default_factory=list)
    rewritten: list[tuple[Entry, float]] = field(default_factory=list)
    planned: set[tuple[str, bytes, bytes]] = field(default_factory=set)  # (tenant, key, version)
    append_bytes: int = 0
    # (tenant, key) of appends that may retire an older version: the key held versions, or
    # the group writes two versions of it. A fresh key (the usual put) needs no retire scan.
    held_keys: set[tuple[str, bytes]] = field(default_factory=set)
    _appended_keys: set[tuple[str, bytes]] = field(default_factory=set)

    def add(self, entry: Entry, shard: bytes | memoryview) -> None:
        tenant_key = (entry.tenant, entry.key)
        if tenant_key in self._appended_keys:
            self.held_keys.add(tenant_key)
        self._appended_keys.add(tenant_key)
        self.planned.add((entry.tenant, entry.key, entry.version))
        self.appends.append((entry, shard))
        self.append_bytes += entry.record_bytes

    def may_retire(self, entry: Entry) -> bool:
        return (entry.tenant, entry.key) in self.held_keys


def _plan_shard(
    held: list[Entry],
    request: PutRequest,
    entry: Entry,
    shard: bytes | memoryview,
    new_entries: list[tuple[Entry, bytes | memoryview]],
    touched: list[tuple[Entry, float]],
    rewritten: list[tuple[Entry, float]],
) -> None:
    """File one shard against the versions held of its key: a re-put of the held version
    (``touched``, and ``rewritten`` when written later), superseded by a newer live version
    (counted), or new (``new_entries``)."""
    live = [e for e in held if not is_expired(e.expires_at_s, request.now)]
    # The same version as another shard index is a node that moved within the
    # group (a map change, kvstore/map_changes.py): the new shard replaces it.
    same = [e for e in live if e.version == entry.version and e.shard_index == entry.shard_index]
    if same:
        touched.append((same[0], request.now))
        # The same version written again, later: it is now as new as that write.
        # Keeping its first write time would let a version written in between
        # win here but lose on nodes that saw the writes in another order, and
        # the block would split between two versions (neither readable).
        if entry.created_s > same[0].created_s:
            rewritten.append((same[0], entry.created_s))
    elif any(e.order > entry.order for e in live):
        request.num_superseded += 1
    else:
        new_entries.append((entry, shard))


def _last_access_s(request: PutRequest, last_access_s: float, written_at_s: float) -> float:
    """A repaired block keeps, as an index rebuild infers it, a TTL of its own that is shorter
    than its class's: it expires sooner than that TTL after its write."""
    if request.expires_at_s > 0 and written_at_s > 0:
        return max(last_access_s, min(written_at_s, request.now))
    return last_access_s


def _shard_checksum(shard: bytes | memoryview) -> int:
    return int.from_bytes(memoryview(shard)[SHARD_CHECKSUM_SLICE], "little")
