"""The read path: live lookups and verified reads of shards. Thread-safe; never writes the index.

Reads run concurrently: each takes an lmdb read snapshot and one ``pread`` per shard. Integrity:
every read checks the record header (right key and tenant at that offset,
kvstore/store/segments.py), the shard checksum and the version against the index. A key's read is
planned from the index first (its newest live version only, or the one asked for:
:meth:`ShardReader.plan`), so a request's reply size is known, and refused when too large, before
any byte is read; a key named twice in one request is read once. :meth:`ShardReader.read_batch`
serves a whole batch read: one index snapshot for every key, one descriptor per segment, one
``preadv`` per shard straight into the caller's staging (the payload stream of
kvstore/wire/batch_answer.py). A shard that fails is reported CORRUPT, counted, never served, and
removed from the index by the next write (kvstore/store/read_state.py) so a repair can store it
again. :meth:`ShardReader.read_batch` and :meth:`ShardReader.read_verified` are the hot paths.

A segment may be moved (carry-forward, compaction) or deleted (expiry) between our index
snapshot and our ``open``: that shows up as ``FileNotFoundError``, and the lookup is repeated
once on a fresh snapshot, which names the record's new place or none.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from erasure.shard import HEADER_BYTES, verify_shard
from kvstore.byte_arena import Region
from kvstore.errors import ChecksumMismatch, CodecError, InvalidArgument
from kvstore.store.index import Index
from kvstore.store.index_codec import Entry, tenant_hash
from kvstore.store.read_state import ReadState
from kvstore.store.record_reads import Outcome, RecordRead, address_of, read_records
from kvstore.store.segments import SegmentFiles
from kvstore.wire import batch_answer
from kvstore.wire.landing import PoolLanding
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
    shards: tuple[bytes, ...] = ()  # the newest version's shard (HIT only)


@dataclass(frozen=True)
class KeyPlan:
    """What a get will read for one key, decided from the index before any byte is read."""

    to_read: tuple[Entry, ...]  # the newest live version (or the one asked for)
    unserved: tuple[Entry, ...]  # entries of the key that cannot be served (expired)

    @property
    def read_bytes(self) -> int:
        return sum(e.shard_bytes for e in self.to_read)


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

    def plan(self, tenant: str, key: bytes, version: bytes, now: float) -> KeyPlan:
        """Which entry a get of ``key`` reads: only the newest live version (or ``version``).

        Older versions are retired when a newer one commits (kvstore/store/group_commit.py), so a
        node normally holds one; reading only the newest keeps a key's read cost one shard.
        """
        live, expired = self.live_entries(tenant, key, now)
        if version:
            live = [e for e in live if e.version == version]
        return KeyPlan(tuple(live[:1]), tuple(live[1:] + expired))

    def read(self, tenant: str, key: bytes, version: bytes, plan: KeyPlan, now: float) -> GetResult:
        """Read ``plan``'s shard, counted as one hit or miss; the plan is made again once if a
        segment moved or was deleted since it was made."""
        for attempt in range(2):
            try:
                return self._record_get(plan, [self.read_verified(e) for e in plan.to_read], now)
            except FileNotFoundError:
                if attempt == 0:
                    plan = self.plan(tenant, key, version, now)
        return self._record_get(KeyPlan((), plan.unserved), [], now)

    def read_batch(
        self,
        tenant: str,
        keys: Sequence[bytes],
        version: bytes,
        now: float,
        take: Callable[[int], Region],
        max_payload_bytes: int | None = None,
        *,
        shared: bool = False,
        pool: PoolLanding | None = None,
    ) -> BatchRead:
        """The newest live version of each key (or ``version``), payloads read into one
        staging region from ``take``, each distinct key read once and counted as one hit or
        miss (a key named again gets a copy of the same answer).

        The payload bytes are summed from the index first: above ``max_payload_bytes`` the
        request gets InvalidArgument having read nothing. This is the node's hot path for
        batch reads: one index snapshot, then every record read in one native call
        (kvstore/store/record_reads.py). A segment gone under us (moved or expired) makes its
        keys be looked up once more, as in :meth:`read`. ``shared``: the staging is memory
        the client can write too (the local channel, kvstore/node/local_server.py); a shard
        that fails its check there is read again into private memory before it is taken for
        corrupt, so a client cannot make the node drop good shards. ``pool``: a local
        client's landing pool and the places its request names (kvstore/wire/landing.py): a
        data shard whose index and length are the place's lands there instead of the staging
        (its table entry says so), and nothing lands there once the request's permit was
        revoked.
        """
        positions = _positions_by_key(keys)
        distinct = list(positions)
        live = self._live_batch(tenant, distinct, version, now)
        payload_bytes = _reply_bytes(live, distinct, positions, range(len(distinct)))
        _check_reply_size(payload_bytes, max_payload_bytes, len(keys), len(distinct))
        places = _pool_places(pool, distinct, positions, live)
        placed_bytes = sum(end - start for start, end in places.values())
        out = _BatchOut(take(payload_bytes - placed_bytes), shared)
        retry = self._read_entries(tenant, live, range(len(distinct)), out, places, pool)
        if retry:
            self._read_again(tenant, distinct, positions, live, retry, version, now, out)
        self._record_outcomes(live, out, now)
        out.spread_to_positions([positions[key] for key in distinct])
        return BatchRead(out.entries, out.staging, out.position)

    def _read_again(
        self,
        tenant: str,
        distinct: list[bytes],
        positions: dict[bytes, list[int]],
        live: list[tuple[list[Entry], list[Entry], list[Entry]]],
        retry: list[int],
        version: bytes,
        now: float,
        out: _BatchOut,
    ) -> None:
        """Look the keys whose segment was gone (``retry``) up on a fresh snapshot and read
        them once more (into the staging, never a pool), the staging grown for what the
        fresh entries hold; a key gone twice is a miss."""
        fresh = self._live_batch(tenant, [distinct[d] for d in retry], version, now)
        for d, found in zip(retry, fresh, strict=True):
            live[d] = found
        out.grow(_reply_bytes(live, distinct, positions, retry))
        for d in self._read_entries(tenant, live, retry, out, {}, None):
            live[d] = ([], [], live[d][2])  # gone twice: a miss

    def _record_outcomes(
        self,
        live: list[tuple[list[Entry], list[Entry], list[Entry]]],
        out: _BatchOut,
        now: float,
    ) -> None:
        """Count each distinct key as one hit or miss; a key nothing was served of gets a
        CORRUPT entry (it had a live entry that failed) or a MISS entry in the table."""
        self._reads.record_hits(list(out.served.values()), now)
        for d, (found, _, expired) in enumerate(live):
            if d not in out.served:
                self._reads.record_miss({e.traffic_class for e in found + expired})
                status = Status.CORRUPT if found else Status.MISS
                out.entries.append(batch_answer.Entry(d, int(status), b"", 0))

    def live_versions(self, tenant: str, keys: Sequence[bytes], now: float) -> list[list[bytes]]:
        """Live versions of each key, newest first, from one index snapshot (Contains); a key
        named twice is looked up once."""
        distinct = list(dict.fromkeys(bytes(key) for key in keys))
        key_to_versions = {
            key: [e.version for e in live]
            for key, (live, _) in zip(
                distinct, self._live_snapshot(tenant, distinct, now), strict=True
            )
        }
        return [key_to_versions[bytes(key)] for key in keys]

    def _live_batch(
        self, tenant: str, keys: Sequence[bytes], version: bytes, now: float
    ) -> list[tuple[list[Entry], list[Entry], list[Entry]]]:
        """Per key: ([the newest live entry, or ``version``'s], [], expired entries), in one
        snapshot (see :meth:`_live_snapshot`)."""
        found = []
        for live, expired in self._live_snapshot(tenant, keys, now):
            wanted = [e for e in live if not version or e.version == version]
            found.append((wanted[:1], [], expired))
        return found

    def _live_snapshot(
        self, tenant: str, keys: Sequence[bytes], now: float
    ) -> list[tuple[list[Entry], list[Entry]]]:
        """Per key: (live entries newest first, expired entries), in one snapshot; keys that
        look expired are looked up again on a fresh one (see :meth:`live_entries`)."""
        with self._index.read() as view:
            per_key = view.versions_of(tenant, keys)
        flat = iter(self._reads.with_refreshes([e for entries in per_key for e in entries]))
        found: list[tuple[list[Entry], list[Entry]]] = []
        for key, held in zip(keys, per_key, strict=True):
            entries = [next(flat) for _ in held]
            if any(is_expired(e.expires_at_s, now) for e in entries):
                found.append(self.live_entries(tenant, key, now))
            elif len(entries) > 1:
                found.append((sorted(entries, key=lambda e: e.order, reverse=True), []))
            else:
                found.append((entries, []))
        return found

    def _read_entries(
        self,
        tenant: str,
        live: list[tuple[list[Entry], list[Entry], list[Entry]]],
        positions: Sequence[int],
        out: _BatchOut,
        places: dict[int, tuple[int, int]],
        pool: PoolLanding | None,
    ) -> list[int]:
        """Read the live entries of the keys at ``positions`` (into ``places`` of the pool,
        or ``out``'s staging); the positions whose segment was gone (to look up again)."""
        reads = [
            _into_pool(pool, i, entry, places[i]) if pool and i in places else out.plan(i, entry)
            for i in positions
            for entry in live[i][0]
        ]
        read_records(
            self._files,
            tenant,
            reads,
            shared=out.shared,
            permit=pool.permit if pool is not None else None,
        )
        retry: list[int] = []
        for read in reads:
            if read.outcome is Outcome.GONE:
                retry.append(read.position)
            elif read.outcome is Outcome.CORRUPT:
                log.error(
                    "corrupt shard %s in segment %d", read.entry.key.hex(), read.entry.segment_id
                )
                self._reads.mark_corrupt(read.entry)
        out.keep_served(reads)
        return retry

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
        live.sort(key=lambda e: e.order, reverse=True)
        return live, expired

    def read_verified(self, entry: Entry) -> bytes | None:
        """The entry's shard bytes, or None (and remembered as corrupt) if they fail a check.

        Raises FileNotFoundError if the entry's segment is gone (moved or expired meanwhile).
        """
        try:
            shard = self._files.read_shard(
                entry.segment_id,
                entry.offset,
                entry.header_bytes,
                entry.shard_bytes,
                entry.key,
                entry.tenant,
                tenant_hash(entry.tenant),
            )
            if verify_shard(shard).block_checksum != entry.version:
                raise ChecksumMismatch("shard version differs from the indexed version")
        except CodecError as exc:
            log.error("corrupt shard %s in segment %d: %s", entry.key.hex(), entry.segment_id, exc)
            self._reads.mark_corrupt(entry)
            return None
        return shard

    def _record_get(self, plan: KeyPlan, shards: list[bytes | None], now: float) -> GetResult:
        hits = [(e, s) for e, s in zip(plan.to_read, shards, strict=True) if s is not None]
        if hits:
            self._reads.record_hit([e for e, _ in hits], now)
            return GetResult(Status.HIT, tuple(s for _, s in hits))
        self._reads.record_miss({e.traffic_class for e in plan.to_read + plan.unserved})
        return GetResult(Status.CORRUPT if plan.to_read else Status.MISS)


def _positions_by_key(keys: Sequence[bytes]) -> dict[bytes, list[int]]:
    """Each distinct key (in first-seen order) -> where it stands in the request."""
    positions: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        positions.setdefault(bytes(key), []).append(i)
    return positions


def _reply_bytes(
    live: list[tuple[list[Entry], list[Entry], list[Entry]]],
    distinct: list[bytes],
    positions: dict[bytes, list[int]],
    indices: Sequence[int],
) -> int:
    """Payload bytes the reply holds for the distinct keys at ``indices``: each live entry's
    payload once per position its key is named at."""
    return sum(
        (e.shard_bytes - HEADER_BYTES) * len(positions[distinct[d]])
        for d in indices
        for e in live[d][0]
    )


def _check_reply_size(
    payload_bytes: int, max_payload_bytes: int | None, num_keys: int, num_distinct: int
) -> None:
    """InvalidArgument, before any byte is read, for a reply above ``max_payload_bytes``."""
    if max_payload_bytes is not None and payload_bytes > max_payload_bytes:
        raise InvalidArgument(
            f"reply of {payload_bytes} bytes for {num_keys} keys ({num_distinct} "
            f"distinct) exceeds max_batch_bytes {max_payload_bytes}; ask for fewer keys "
            "per request"
        )


def _pool_places(
    pool: PoolLanding | None,
    distinct: list[bytes],
    positions: dict[bytes, list[int]],
    live: list[tuple[list[Entry], list[Entry], list[Entry]]],
) -> dict[int, tuple[int, int]]:
    """Distinct key -> the range of the client's pool its shard goes to, for keys named once
    whose place fits the shard they serve (kvstore/wire/landing.py ``Place.range_for``)."""
    if pool is None:
        return {}
    places: dict[int, tuple[int, int]] = {}
    for d, key in enumerate(distinct):
        request_positions = positions[key]
        place = pool.places[request_positions[0]] if len(request_positions) == 1 else None
        if place is None or len(live[d][0]) != 1:
            continue
        entry = live[d][0][0]
        span = place.range_for(entry.shard_index, entry.shard_bytes - HEADER_BYTES)
        if span is not None and span[1] <= len(pool.memory):
            places[d] = span
    return places


def _into_pool(pool: PoolLanding, position: int, entry: Entry, span: tuple[int, int]) -> RecordRead:
    start, end = span
    return RecordRead(position, entry, pool.memory[start:end], pool.address + start, True)


class _BatchOut:
    """The table and payload stream of a batch read as it is filled (see read_batch)."""

    def __init__(self, staging: Region, shared: bool = False) -> None:
        self.staging = staging
        self._address = address_of(staging.view)  # where the stream starts in this process
        self.shared = shared  # the staging is a local client's arena (see read_batch)
        self.position = 0  # payload bytes kept so far
        self.entries: list[batch_answer.Entry] = []
        self.served: dict[int, list[Entry]] = {}  # key position -> entries served
        self._planned = 0  # stream bytes handed to planned reads not yet kept

    def plan(self, position: int, entry: Entry) -> RecordRead:
        """A read of ``entry`` whose payload goes to the next free part of the stream."""
        start = self.position + self._planned
        num_bytes = entry.shard_bytes - HEADER_BYTES
        self._planned += num_bytes
        view = self.staging.view[start : start + num_bytes]
        return RecordRead(position, entry, view, self._address + start)

    def keep_served(self, reads: Sequence[RecordRead]) -> None:
        """File every served read in the table; stream payloads of reads that failed leave
        gaps, closed here by moving the later payloads down (rare: a corrupt or gone shard)."""
        write = self.position
        for read in reads:
            if read.outcome is not Outcome.SERVED:
                continue
            placed = read.in_pool
            if not placed:
                start = read.address - self._address
                if start != write:
                    self.staging.view[write : write + len(read.destination)] = read.destination
                write += len(read.destination)
            self.entries.append(
                batch_answer.Entry(
                    read.position,
                    batch_answer.HIT,
                    read.shard_header,
                    0 if placed else len(read.destination),
                    placed,
                )
            )
            self.served.setdefault(read.position, []).append(read.entry)
        self.position, self._planned = write, 0

    def grow(self, num_bytes: int) -> None:
        """Make room for ``num_bytes`` more (a retry found entries the first pass had not)."""
        needed = self.position + num_bytes
        if needed <= len(self.staging.view):
            return
        bigger = Region(None, 0, memoryview(bytearray(needed)))
        bigger.view[: self.position] = self.staging.view[: self.position]
        self.staging.release()
        self.staging = bigger
        self._address = address_of(bigger.view)

    def spread_to_positions(self, positions: Sequence[Sequence[int]]) -> None:
        """Entries were filed by distinct key (``positions[d]``: where key d stands in the
        request): file each under the key's first position, and copy it, payload included,
        for every later position (the staging has room: the reply size counted them)."""
        if all(len(p) == 1 and p[0] == d for d, p in enumerate(positions)):
            return  # every key named once, in order: filed right already
        self.grow(sum(e.payload_bytes * (len(positions[e.key_index]) - 1) for e in self.entries))
        kept = list(zip(self.entries, self._offsets(), strict=True))
        self.entries = []
        for entry, _ in kept:
            self.entries.append(entry._replace(key_index=positions[entry.key_index][0]))
        for entry, start in kept:
            for position in positions[entry.key_index][1:]:
                end = self.position + entry.payload_bytes
                self.staging.view[self.position : end] = self.staging.view[
                    start : start + entry.payload_bytes
                ]
                self.entries.append(entry._replace(key_index=position))
                self.position = end

    def _offsets(self) -> list[int]:
        offsets, start = [], 0
        for entry in self.entries:
            offsets.append(start)
            start += entry.payload_bytes
        return offsets
