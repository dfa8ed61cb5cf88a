"""The write path: puts queue up and the first to get the write lock commits them all at once.

A put request is all-or-nothing::

    check every shard (key size, class, size, verify_shard)     -> InvalidArgument, nothing done
                                                                   (kvstore/request_checks.py)
    queue it; under the write lock take the whole queue:
      persist read-side state (refreshes, counts, corrupt shards)
      per request: new shards vs re-puts; make room (expire,     -> CapacityExhausted fails that
        then evict in the configured order, sparing the            request alone
        group's re-puts)
      append every new record, fsync each segment once, commit   <- the commit point
        one index transaction (kvstore/segment_appender.py)
      (an unexpected failure fails every request of the group: none is left silently unstored)

Concurrent puts wait on the write lock anyway; the first to get it stores them all, so N
concurrent requests cost one round of fsyncs instead of N.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from erasure.shard import HEADER_BYTES
from kvstore.errors import CapacityExhausted
from kvstore.eviction import Evictor
from kvstore.index import Entry, Index
from kvstore.read_state import ReadState
from kvstore.segment_appender import SegmentAppender
from kvstore.segments import record_bytes
from ttl.policy import Retention, is_expired

SHARD_CHECKSUM_SLICE = slice(HEADER_BYTES - 8, HEADER_BYTES)  # erasure/shard.py header layout


@dataclass
class PutRequest:
    """A checked put waiting for the group commit that stores it (or fails it)."""

    tenant: str
    traffic_class: str
    items: list[tuple[bytes, bytes, bytes]]  # (key, version, shard)
    now: float
    done: bool = False
    num_stored: int = 0
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
        appends: list[tuple[Entry, bytes]] = []
        refreshed: list[tuple[Entry, float]] = []
        for request in batch:
            try:
                self._plan_put(request, appends, refreshed)
            except CapacityExhausted as exc:
                request.error = exc
        also = partial(self._reads.persist_refreshes, refreshed=refreshed)
        self._appender.append_and_commit(appends, also=also)

    def _plan_put(
        self,
        request: PutRequest,
        appends: list[tuple[Entry, bytes]],
        refreshed: list[tuple[Entry, float]],
    ) -> None:
        """Add ``request``'s new shards to ``appends`` and re-puts to ``refreshed``; make room.

        A re-put only refreshes the held entry (at the commit). Making room never evicts an
        entry the group re-puts: the re-put is an access, and the put reports it stored.
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
        keep = {e.index_key for e, _ in [*refreshed, *touched]}
        self._evictor.make_room(need_bytes, request.now, keep)
        appends.extend(new_entries)
        refreshed.extend(touched)
        request.num_stored = len(new_entries)

    def _new_entry(self, request: PutRequest, key: bytes, version: bytes, shard: bytes) -> Entry:
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
            expires_at_s=self._retention().expires_at_s(
                request.tenant, request.traffic_class, request.now
            ),
        )
