"""Deletion that reaches the bytes: delete, purge, tombstones from peers, and the erase queue.

A delete removes the index entries *and* destroys the records' bytes on disk::

    one index transaction: delete the entries           <- the delete is committed here
                           queue each record in ``erase``
                           append a tombstone per key (or one for the tenant) to the delete log
    then, still under the write lock: punch a hole over each queued record (or write zeros),
                           fsync, and drop it from the queue

So a committed delete's bytes are unreadable on disk before the call returns. A crash in
between, or an erase that failed (an I/O error), leaves the record queued, and the next upkeep
tick (at most a second later) or the start-up erases it: well inside the 60 s bound the
docs/security.md promises.

Nodes that were down or cut off during a delete learn it from the delete log: each node pulls
its peers' tombstones (kvstore/node/tombstones.py) and applies them here. A tombstone deletes the
versions created at or before its time, so a block written again after the delete survives.
The rule for repair: a repair must never resurrect a deleted block. A node applies its
peers' tombstones before it serves as a repair source, and a repaired shard is written with
the created time of its source; one older than a tombstone the target holds is dropped
(kvstore/store/group_commit.py: every local delete, purge and applied tombstone is also noted by
key, in ``deleted``, for as long as the delete log keeps it).

Single writer: callers hold the store's write lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.store.index import Index, IndexWriter
from kvstore.store.index_codec import Entry, Tombstone
from kvstore.store.segments import SegmentFiles
from kvstore.store.store_stats import PEER_REMOVED_SHARDS

log = logging.getLogger(__name__)

_BATCH = 4096


@dataclass(frozen=True)
class Erased:
    """What one delete, purge or tombstone batch removed on this node."""

    num_shards: int = 0
    num_bytes: int = 0


class Deleter:
    """Deletes entries and destroys their records (see the module docstring)."""

    def __init__(self, index: Index, files: SegmentFiles) -> None:
        self._index = index
        self._files = files

    def delete(self, tenant: str, keys: Sequence[bytes], now: float) -> Erased:
        """Delete every version of ``keys`` owned by ``tenant`` and log a tombstone per key."""
        with self._index.write() as w:
            victims = [e for key in keys for e in w.versions(tenant, key)]
            _remove(w, victims)
            for key in dict.fromkeys(bytes(k) for k in keys):
                w.log_tombstone(tenant, key, now)
        self.erase_queued()
        return _erased(victims)

    def purge(self, tenant: str, now: float) -> Erased:
        """Delete every entry of ``tenant`` and log one tombstone for the whole tenant."""
        num_shards = num_bytes = 0
        start = b""
        while True:
            with self._index.write() as w:
                batch = w.tenant_entries(tenant, start, _BATCH)
                _remove(w, batch)
                if len(batch) < _BATCH:
                    w.log_tombstone(tenant, b"", now)
            num_shards += len(batch)
            num_bytes += sum(e.record_bytes for e in batch)
            self.erase_queued()
            if len(batch) < _BATCH:
                return Erased(num_shards, num_bytes)
            start = batch[-1].index_key + b"\x00"

    def apply(self, tombstones: Iterable[Tombstone]) -> Erased:
        """Apply peers' tombstones: delete versions created at or before each one's time.

        Not logged again: every node pulls from every peer of its groups itself. Noted by key,
        though, so this node refuses a repair's shard of such a version too.
        """
        victims: list[Entry] = []
        with self._index.write() as w:
            for t in tombstones:
                held = w.versions(t.tenant, t.key) if t.key else _all_of_tenant(w, t.tenant)
                doomed = [e for e in held if e.created_s <= t.at_s]
                _remove(w, doomed)
                victims += doomed
                w.note_deleted(t.tenant, t.key, t.at_s)
            w.add(PEER_REMOVED_SHARDS, len(victims))
        self.erase_queued()
        return _erased(victims)

    def erase_queued(self) -> int:
        """Destroy the bytes of every queued record; return how many were erased."""
        num_erased = 0
        while True:
            with self._index.read() as view:
                queued = view.erase_queue(_BATCH)
            if not queued:  # the common case: no write transaction at all
                return num_erased
            done = [item for item in queued if self._erase_one(*item)]
            with self._index.write() as w:
                for segment_id, offset, _ in done:
                    w.erased(segment_id, offset)
            num_erased += len(done)
            if len(queued) < _BATCH or len(done) < len(queued):
                return num_erased  # a failed erase stays queued for the next tick

    def prune_log(self, before_s: float) -> None:
        """Drop delete-log records older than ``before_s`` (a write only when some are)."""
        with self._index.read() as view:
            oldest = view.tombstones(0, 1)
        if oldest and oldest[0].at_s < before_s:
            with self._index.write() as w:
                w.prune_tombstones(before_s)

    def _erase_one(self, segment_id: int, offset: int, length: int) -> bool:
        try:
            self._files.erase(segment_id, offset, length)
        except OSError as exc:
            log.error(
                "erasing %d bytes at %d of segment %d failed: %s", length, offset, segment_id, exc
            )
            return False
        return True


def _remove(w: IndexWriter, entries: Iterable[Entry]) -> None:
    for entry in entries:
        if w.delete_entry(entry):
            w.queue_erase(entry)


def _all_of_tenant(w: IndexWriter, tenant: str) -> list[Entry]:
    found, start = [], b""
    while batch := w.tenant_entries(tenant, start, _BATCH):
        found += batch
        start = batch[-1].index_key + b"\x00"
    return found


def _erased(victims: Sequence[Entry]) -> Erased:
    return Erased(len(victims), sum(e.record_bytes for e in victims))
