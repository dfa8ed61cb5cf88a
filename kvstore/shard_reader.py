"""The read path: live lookups and verified reads of shards. Thread-safe; never writes the index.

Reads run concurrently: each takes an lmdb read snapshot and one ``pread`` per shard. Integrity:
every read checks the record header (right key and tenant at that offset, kvstore/segments.py),
the shard checksum and the version against the index. A shard that fails is reported CORRUPT,
counted, never served, and removed from the index by the next write (kvstore/read_state.py) so
a repair can store it again. :meth:`ShardReader.read_verified` is this module's hot path.

A segment may be moved (carry-forward, compaction) or deleted (expiry) between our index
snapshot and our ``open``: that shows up as ``FileNotFoundError``, and the lookup is repeated
once on a fresh snapshot, which names the record's new place or none.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from erasure.shard import verify_shard
from kvstore.errors import ChecksumMismatch, CodecError
from kvstore.index import Entry, Index, tenant_hash
from kvstore.read_state import ReadState
from kvstore.segments import SegmentFiles
from ttl.policy import is_expired

log = logging.getLogger(__name__)


class Status(enum.IntEnum):
    """Per-key outcome of a get; the numbers match the wire's ShardStatus."""

    MISS = 0
    HIT = 1
    CORRUPT = 2


@dataclass(frozen=True)
class GetResult:
    status: Status
    shards: tuple[bytes, ...] = ()  # one per version held, newest first (HIT only)


class ShardReader:
    """Lookups over the index and verified reads of segment records."""

    def __init__(self, index: Index, files: SegmentFiles, reads: ReadState) -> None:
        self._index = index
        self._files = files
        self._reads = reads

    def get_one(self, tenant: str, key: bytes, version: bytes, now: float) -> GetResult:
        """Every live version of ``key`` (or only ``version``), counted as one hit or miss."""
        try:
            found = self._read_live(tenant, key, version, now)
        except FileNotFoundError:  # a segment moved or was deleted under us: look once more
            try:
                found = self._read_live(tenant, key, version, now)
            except FileNotFoundError:
                found = ([], [], [])
        return self._record_get(*found, now)

    def live_entries(self, tenant: str, key: bytes, now: float) -> tuple[list[Entry], list[Entry]]:
        """(live entries newest first, expired entries) of a key, TTL refreshes applied.

        If anything looks expired the lookup is repeated on a fresh snapshot: a refresh may have
        been persisted (and dropped from memory) between our snapshot and our memory check.
        """
        for _ in range(2):
            with self._index.read() as view:
                entries = [self._reads.with_refresh(e) for e in view.versions(tenant, key)]
            expired = [e for e in entries if is_expired(e.expires_at_s, now)]
            if not expired:
                break
        live = [e for e in entries if not is_expired(e.expires_at_s, now)]
        live.sort(key=lambda e: e.created_s, reverse=True)
        return live, expired

    def read_verified(self, entry: Entry) -> bytes | None:
        """The entry's shard bytes, or None (and remembered as corrupt) if they fail a check.

        Raises FileNotFoundError if the entry's segment is gone (moved or expired meanwhile).
        """
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
            self._reads.mark_corrupt(entry)
            return None
        return shard

    def _read_live(
        self, tenant: str, key: bytes, version: bytes, now: float
    ) -> tuple[list[Entry], list[bytes | None], list[Entry]]:
        """(live entries, their shard bytes or None if corrupt, expired entries)."""
        live, expired = self.live_entries(tenant, key, now)
        live = [e for e in live if not version or e.version == version]
        return live, [self.read_verified(e) for e in live], expired

    def _record_get(
        self, live: list[Entry], shards: list[bytes | None], expired: list[Entry], now: float
    ) -> GetResult:
        hits = [(e, s) for e, s in zip(live, shards, strict=True) if s is not None]
        if hits:
            self._reads.record_hit([e for e, _ in hits], now)
            return GetResult(Status.HIT, tuple(s for _, s in hits))
        self._reads.record_miss({e.traffic_class for e in live + expired})
        return GetResult(Status.CORRUPT if live else Status.MISS)
