"""The read path: live lookups and verified reads of shards. Thread-safe; never writes the index.

Reads run concurrently: each takes an lmdb read snapshot and one ``pread`` per shard. Integrity:
every read checks the record header (right key and tenant at that offset, kvstore/segments.py),
the shard checksum and the version against the index. :meth:`ShardReader.read_batch` serves a
whole batch read: one index snapshot for every key, one descriptor per segment, one ``preadv``
per shard straight into the caller's staging (the payload stream of kvstore/batch_answer.py).
A shard that fails is reported CORRUPT, counted, never served, and removed from the index by
the next write (kvstore/read_state.py) so a repair can store it again.
:meth:`ShardReader.read_batch` and :meth:`ShardReader.read_verified` are the hot paths.

A segment may be moved (carry-forward, compaction) or deleted (expiry) between our index
snapshot and our ``open``: that shows up as ``FileNotFoundError``, and the lookup is repeated
once on a fresh snapshot, which names the record's new place or none.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from erasure.shard import HEADER_BYTES, SplitShard, verify_shard
from kvstore import batch_answer
from kvstore.byte_arena import Region
from kvstore.errors import ChecksumMismatch, CodecError
from kvstore.index import Entry, Index, tenant_hash
from kvstore.read_state import ReadState
from kvstore.segments import RECORD_HEADER_BYTES, SegmentFiles
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


@dataclass
class BatchRead:
    """A node's answer to one batch read: the table's entries and the staging holding the
    payloads (``payloads``, the first ``payload_bytes`` of it); release it once sent."""

    entries: list[batch_answer.Entry]
    staging: Region | None
    payload_bytes: int

    @property
    def payloads(self) -> memoryview:
        return self.staging.view[: self.payload_bytes] if self.staging else memoryview(b"")

    def release(self) -> None:
        if self.staging is not None:
            self.staging.release()


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

    def read_batch(
        self,
        tenant: str,
        keys: Sequence[bytes],
        version: bytes,
        now: float,
        take: Callable[[int], Region],
    ) -> BatchRead:
        """Every live version of each key (or only ``version``), payloads read into one
        staging region from ``take``, each key counted as one hit or miss.

        This is the node's hot path for batch reads: one index snapshot, then per shard one
        ``preadv`` and one checksum pass; Python work per shard is a few calls. A segment
        gone under us (moved or expired) makes its keys be looked up once more, as in
        :meth:`get_one`.
        """
        live = self._live_batch(tenant, keys, version, now)
        staging = take(sum(e.shard_bytes - HEADER_BYTES for found in live for e in found[0]))
        out = _BatchOut(staging)
        retry = self._read_entries(tenant, live, range(len(keys)), out)
        if retry:
            fresh = self._live_batch(tenant, [keys[i] for i in retry], version, now)
            for i, found in zip(retry, fresh, strict=True):
                live[i] = found
            out.grow(sum(e.shard_bytes - HEADER_BYTES for i in retry for e in live[i][0]))
            for i in self._read_entries(tenant, live, retry, out):
                live[i] = ([], [], live[i][2])  # gone twice: a miss
        for i, (found, _, expired) in enumerate(live):
            served = out.served.get(i, [])
            if served:
                self._reads.record_hit(served, now)
            else:
                self._reads.record_miss({e.traffic_class for e in found + expired})
                status = Status.CORRUPT if found else Status.MISS
                out.entries.append(batch_answer.Entry(i, int(status), b"", 0))
        return BatchRead(out.entries, out.staging, out.position)

    def _live_batch(
        self, tenant: str, keys: Sequence[bytes], version: bytes, now: float
    ) -> list[tuple[list[Entry], list[Entry], list[Entry]]]:
        """Per key: (live entries newest first, [], expired entries), in one snapshot; keys
        that look expired are looked up again on a fresh one (see :meth:`live_entries`)."""
        with self._index.read() as view:
            per_key = [
                [self._reads.with_refresh(e) for e in view.versions(tenant, k)] for k in keys
            ]
        found = []
        for key, entries in zip(keys, per_key, strict=True):
            if any(is_expired(e.expires_at_s, now) for e in entries):
                live, expired = self.live_entries(tenant, key, now)
            else:
                live, expired = sorted(entries, key=lambda e: e.created_s, reverse=True), []
            found.append(([e for e in live if not version or e.version == version], [], expired))
        return found

    def _read_entries(
        self,
        tenant: str,
        live: list[tuple[list[Entry], list[Entry], list[Entry]]],
        positions: Sequence[int],
        out: _BatchOut,
    ) -> list[int]:
        """Read the live entries of the keys at ``positions`` into ``out``; the positions
        whose segment was gone (to look up again)."""
        retry: list[int] = []
        fds: dict[int, int] = {}
        head = bytearray(RECORD_HEADER_BYTES + HEADER_BYTES)
        owner = tenant_hash(tenant)
        try:
            for i in positions:
                try:
                    for entry in live[i][0]:
                        self._read_one(entry, i, owner, fds, head, out)
                except FileNotFoundError:
                    out.served.pop(i, None)
                    out.drop_key(i)
                    retry.append(i)
        finally:
            for fd in fds.values():
                os.close(fd)
        return retry

    def _read_one(
        self,
        entry: Entry,
        position: int,
        owner: bytes,
        fds: dict[int, int],
        head: bytearray,
        out: _BatchOut,
    ) -> None:
        fd = fds.get(entry.segment_id)
        if fd is None:
            fd = fds[entry.segment_id] = self._files.open_reader(entry.segment_id)
        payload = out.next_payload(entry.shard_bytes - HEADER_BYTES)
        try:
            header = SegmentFiles.read_into(fd, entry.offset, payload, entry.key, owner, head)
            if verify_shard(SplitShard(header, payload)).block_checksum != entry.version:
                raise ChecksumMismatch("shard version differs from the indexed version")
        except CodecError as exc:
            log.error("corrupt shard %s in segment %d: %s", entry.key.hex(), entry.segment_id, exc)
            self._reads.mark_corrupt(entry)
            return
        out.keep(position, entry, bytes(header), len(payload))

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


class _BatchOut:
    """The table and payload stream of a batch read as it is filled (see read_batch)."""

    def __init__(self, staging: Region) -> None:
        self.staging = staging
        self.position = 0  # payload bytes kept so far
        self.entries: list[batch_answer.Entry] = []
        self.served: dict[int, list[Entry]] = {}  # key position -> entries served

    def next_payload(self, num_bytes: int) -> memoryview:
        """Where the next payload goes; it counts only once :meth:`keep` is called."""
        return self.staging.view[self.position : self.position + num_bytes]

    def keep(self, position: int, entry: Entry, header: bytes, num_bytes: int) -> None:
        self.entries.append(batch_answer.Entry(position, batch_answer.HIT, header, num_bytes))
        self.served.setdefault(position, []).append(entry)
        self.position += num_bytes

    def drop_key(self, position: int) -> None:
        """Forget what was kept of one key (its segment vanished mid-read): compact."""
        kept = list(zip(self.entries, self._offsets(), strict=True))
        stream = self.staging.view
        self.entries, write = [], 0
        for entry, start in kept:
            if entry.key_index == position:
                continue
            stream[write : write + entry.payload_bytes] = stream[
                start : start + entry.payload_bytes
            ]
            self.entries.append(entry)
            write += entry.payload_bytes
        self.position = write

    def grow(self, num_bytes: int) -> None:
        """Make room for ``num_bytes`` more (a retry found entries the first pass had not)."""
        needed = self.position + num_bytes
        if needed <= len(self.staging.view):
            return
        bigger = Region(None, 0, memoryview(bytearray(needed)))
        bigger.view[: self.position] = self.staging.view[: self.position]
        self.staging.release()
        self.staging = bigger

    def _offsets(self) -> list[int]:
        offsets, start = [], 0
        for entry in self.entries:
            offsets.append(start)
            start += entry.payload_bytes
        return offsets
