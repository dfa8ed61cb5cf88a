"""What reads learn, held in memory until a write persists it: refreshes, counts, corrupt shards.

Reads never write the index: lmdb has one writer, and concurrent reads must not queue behind
it. A read hit refreshes the TTL here first, hits and misses are counted here, and shards that
fail a check are remembered here. The next write or the background tick (at least once a second
on a node) persists all of it in one index transaction (:meth:`ReadState.flush`). A crash can
lose refreshes younger than that: those blocks then expire counting from their previous access.
Expired entries are never served meanwhile: every read checks ``expires_at_s`` (with the
refresh applied) against ``now`` before reclamation catches up.

A shard found corrupt is counted at once (:meth:`ReadState.pending_counters`) and removed from
the index by the next flush (:func:`quarantine`), so a repair can store it again; it is counted
once however often it is found.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvstore.errors import UnknownTrafficClass
from kvstore.store.index import Index, IndexWriter, class_counter
from kvstore.store.index_codec import Entry
from kvstore.store.store_stats import CORRUPT_SHARDS, NODE_MISSES
from ttl.policy import Retention

# Float rounding of ``expires_at_s - last_access_s`` stays far below this (a millisecond).
TTL_ROUNDING_S = 1e-3
# A hit within this share of an entry's TTL of its last access, or within the configured
# ``[ttl] refresh_granularity_s`` (60 s) if sooner, restarts nothing: a prefix read many times
# a second would otherwise rewrite its index entry at every flush (2-core storage bench, 12
# nodes, the same blocks read over and over: the refreshes' index writes were a sixth of a
# node's Python time). The price: a block may expire, and LRU may see it as idle, up to that
# much early: 60 s of the 3-day agent class.
REFRESH_SHARE = 1e-3


def touched(entry: Entry, now: float, retention: Retention) -> Entry:
    """``entry`` accessed at ``now``: its TTL restarts (kept if its class was removed)."""
    try:
        ttl_s = retention.ttl_s(entry.tenant, entry.traffic_class)
    except UnknownTrafficClass:
        return entry
    return entry.accessed(now, now + entry_ttl_s(entry, ttl_s))


def refresh_due(entry: Entry, now: float, granularity_s: float) -> bool:
    """Whether a hit at ``now`` restarts ``entry``'s TTL (``entry`` with its buffered refresh
    applied): not within REFRESH_SHARE of its TTL span, or ``granularity_s`` if sooner, of its
    last access."""
    span_s = entry.expires_at_s - entry.last_access_s
    return now - entry.last_access_s >= min(granularity_s, span_s * REFRESH_SHARE)


def entry_ttl_s(entry: Entry, ttl_s: float) -> float:
    """The TTL ``entry`` lives by: ``ttl_s`` (its class's, within its tenant's cap), or the
    shorter one it was stored with (a put's own ``ttl_s``, or a cap that cut it): the span
    from its last access to its expiry. So a block keeps the shortest TTL it was stored or
    cut under; a longer class TTL or a looser cap reaches the blocks written after it."""
    span_s = entry.expires_at_s - entry.last_access_s
    return span_s if span_s < ttl_s - TTL_ROUNDING_S else ttl_s


def quarantine(w: IndexWriter, corrupt: Iterable[Entry]) -> None:
    """Delete entries found corrupt and count them, unless they have since moved or gone."""
    for entry in corrupt:
        held = w.entry(entry.tenant, entry.key, entry.version)
        if held is not None and (held.segment_id, held.offset) == (entry.segment_id, entry.offset):
            w.delete_entry(held)
            w.add(CORRUPT_SHARDS, 1)


class ReadState:
    """Thread-safe buffers of read-side state (see the module docstring)."""

    def __init__(self, retention: Callable[[], Retention], refresh_granularity_s: float) -> None:
        self._retention = retention  # the store's current TTLs and tenant caps
        self._granularity_s = refresh_granularity_s  # refresh_due's
        self._lock = threading.Lock()
        self._refreshed: dict[bytes, tuple[Entry, float]] = {}  # index key -> (entry, hit time)
        self._counts: Counter[str] = Counter()  # hits/misses not yet persisted
        self._corrupt: dict[bytes, Entry] = {}  # found by reads, removed by the next flush

    def with_refresh(self, entry: Entry) -> Entry:
        """``entry`` with its latest in-memory TTL refresh applied."""
        with self._lock:
            refreshed = self._refreshed.get(entry.index_key)
        if refreshed is None or refreshed[1] <= entry.last_access_s:
            return entry
        return touched(entry, refreshed[1], self._retention())

    def with_refreshes(self, entries: Sequence[Entry]) -> list[Entry]:
        """:meth:`with_refresh` of many entries under one lock (a batch read's lookups)."""
        with self._lock:
            refreshes = [self._refreshed.get(entry.index_key) for entry in entries]
        return [
            entry
            if refreshed is None or refreshed[1] <= entry.last_access_s
            else touched(entry, refreshed[1], self._retention())
            for entry, refreshed in zip(entries, refreshes, strict=True)
        ]

    def record_hit(self, served: Sequence[Entry], now: float) -> None:
        """Refresh every served entry; count one hit, for the class of the first."""
        self.record_hits([served], now)

    def record_hits(self, served_per_key: Sequence[Sequence[Entry]], now: float) -> None:
        """:meth:`record_hit` for every key of a batch read, under one lock."""
        with self._lock:
            for served in served_per_key:
                for entry in served:
                    if refresh_due(entry, now, self._granularity_s):
                        self._refreshed[entry.index_key] = (entry, now)
                self._counts[class_counter(served[0].traffic_class, "hits")] += 1

    def record_touch(self, touched_entries: Sequence[Entry], now: float) -> None:
        """Refresh entries a client touched (its read hit was served by other nodes)."""
        with self._lock:
            for entry in touched_entries:
                if refresh_due(entry, now, self._granularity_s):
                    self._refreshed[entry.index_key] = (entry, now)

    def record_miss(self, class_names: Iterable[str]) -> None:
        """Count one miss for the node and one for each class the key had entries of."""
        with self._lock:
            self._counts[NODE_MISSES] += 1
            for name in class_names:
                self._counts[class_counter(name, "misses")] += 1

    def mark_corrupt(self, entry: Entry) -> None:
        with self._lock:
            self._corrupt[entry.index_key] = entry

    def forget_corrupt(self, entries: Iterable[Entry]) -> None:
        """These were dropped by another transaction: the next flush has nothing to do."""
        with self._lock:
            for entry in entries:
                self._corrupt.pop(entry.index_key, None)

    def pending_counters(self) -> Counter[str]:
        """Counts not persisted yet, corrupt shards included."""
        with self._lock:
            counts = Counter(self._counts)
            counts[CORRUPT_SHARDS] += len(self._corrupt)
        return counts

    def persist_refreshes(self, w: IndexWriter, refreshed: Iterable[tuple[Entry, float]]) -> None:
        """Write (entry, access time) refreshes to entries still held and not newer."""
        for entry, hit_s in refreshed:
            held = w.entry(entry.tenant, entry.key, entry.version)
            if held is not None and held.last_access_s < hit_s:
                w.put_entry(touched(held, hit_s, self._retention()))

    def flush(self, index: Index) -> None:
        """Persist everything buffered in one transaction (caller holds the write lock)."""
        with self._lock:
            refreshed = dict(self._refreshed)
            counts = Counter(self._counts)
            corrupt = dict(self._corrupt)
        if not (refreshed or counts or corrupt):
            return
        with index.write() as w:
            self.persist_refreshes(w, refreshed.values())
            for name, delta in counts.items():
                w.add(name, delta)
            quarantine(w, corrupt.values())
        self._forget(refreshed, counts, corrupt)

    def _forget(
        self,
        refreshed: dict[bytes, tuple[Entry, float]],
        counts: Counter[str],
        corrupt: dict[bytes, Entry],
    ) -> None:
        """Drop what a flush persisted; keep what reads added meanwhile."""
        with self._lock:
            for index_key, value in refreshed.items():
                if self._refreshed.get(index_key) == value:
                    del self._refreshed[index_key]
            self._counts.subtract(counts)
            self._counts = +self._counts
            for index_key in corrupt:
                self._corrupt.pop(index_key, None)
