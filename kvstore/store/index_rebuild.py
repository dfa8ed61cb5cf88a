"""Rebuilding a lost or damaged index from the segment records alone.

Format-2 records (kvstore/store/segments.py) name their key, tenant, class, shard index, write time
and expiry, so the index can be rebuilt from them when it is lost (``index/`` deleted, a disk
restored without it) or damaged (lmdb pages that fail to read; the damaged files are moved
aside, never reused). Start-up decides (kvstore/store/recovery.py); the node answers Health with
``serving = false`` until the rebuild is done.

Every segment file, in id order::

    scan records (kvstore/store/segments.py SegmentFiles.scan: intact headers back to back, with
      the runs of bytes between them that are no intact record)
    each record: read the shard, verify it (shard checksum, version, key, shard index);
      skip it if it expired, fails a check, or an equal or newer copy is indexed already
      (carry-forward leaves old copies behind until their file goes); a newer version of a
      key retires the older ones, exactly as a put does
    register the segment (its window from its records' expiry) and the surviving entries

What it never does is delete bytes it cannot account for. A segment holding anything but
intact format-2 records (bytes a torn write, another program or a format-1 writer left) is
indexed for the records it has, and marked: when it is freed it moves to ``quarantine/``
instead of being deleted. A file with no usable record moves there at once. The operator
decides what to do with them (``kvstore cluster status`` shows their bytes).

What a rebuild loses: TTL refreshes persisted only in the index (entries expire counting from
the record's expiry, which carry-forward rewrites; repair rebuilds any shard that expires before
its block), the scrub's and eviction counters, and the tombstones of deletes. A shard deleted
on this node whose record was still on disk comes back; it is one shard, which never makes a
deleted block readable on its own (a read needs k), and issue #19's deletion that reaches the
bytes closes it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from erasure.shard import verify_shard
from kvstore.errors import CodecError, UnknownTrafficClass
from kvstore.store.index import CURRENT_INDEX_FORMAT, INDEX_FORMAT, Index, IndexWriter
from kvstore.store.index_codec import Entry
from kvstore.store.segment_appender import window_id
from kvstore.store.segments import (
    RECORD_FORMAT,
    RecordHeader,
    ScannedRecord,
    SegmentFiles,
    UnaccountedBytes,
)
from ttl.policy import TrafficClasses, is_expired

log = logging.getLogger(__name__)

_COMMIT_EVERY = 1024  # records per index transaction


@dataclass
class RebuildReport:
    """What a rebuild found."""

    num_segments: int = 0
    num_entries: int = 0
    num_expired: int = 0
    num_duplicates: int = 0  # older copies of a record, or older versions of a key
    num_bad_records: int = 0  # intact header, shard failing its checks
    unaccounted_bytes: int = 0
    quarantined_segment_ids: list[int] = field(default_factory=list)


def rebuild_index(
    index: Index,
    files: SegmentFiles,
    classes: TrafficClasses,
    expiry_window_s: float,
    now: float,
) -> RebuildReport:
    """Fill a blank ``index`` from every segment file; return what was found."""
    report = RebuildReport()
    for segment_id in sorted(files.ids_on_disk()):
        _rebuild_segment(index, files, classes, expiry_window_s, now, segment_id, report)
    with index.write() as w:
        w.set_counter(INDEX_FORMAT, CURRENT_INDEX_FORMAT)
        report.num_entries = sum(
            int(value) for name, value in w.counters().items() if name.endswith("/blocks")
        )
    log.warning(
        "rebuilt the index from %d segments: %d entries (%d expired, %d duplicates, %d bad "
        "records skipped), %d bytes unaccounted for, %d segments to quarantine",
        report.num_segments,
        report.num_entries,
        report.num_expired,
        report.num_duplicates,
        report.num_bad_records,
        report.unaccounted_bytes,
        len(report.quarantined_segment_ids),
    )
    return report


def _rebuild_segment(
    index: Index,
    files: SegmentFiles,
    classes: TrafficClasses,
    expiry_window_s: float,
    now: float,
    segment_id: int,
    report: RebuildReport,
) -> None:
    found = list(files.scan(segment_id))
    records = [r for r in found if isinstance(r, ScannedRecord)]
    current = [r for r in records if r.header.record_format == RECORD_FORMAT]
    unaccounted = sum(g.num_bytes for g in found if isinstance(g, UnaccountedBytes))
    unaccounted += sum(r.header.record_bytes for r in records if r not in current)
    report.unaccounted_bytes += unaccounted
    if not current:
        log.error("segment %d holds no usable record: moving it to quarantine/", segment_id)
        files.quarantine(segment_id, "no-records")
        report.quarantined_segment_ids.append(segment_id)
        return
    report.num_segments += 1
    window = window_id(current[0].header.expires_at_s, expiry_window_s)
    with index.write() as w:
        w.add_segment(segment_id, window)
        w.set_committed_bytes(segment_id, files.size(segment_id) or 0)
        if unaccounted:
            w.mark_quarantined(segment_id, "unaccounted")
            report.quarantined_segment_ids.append(segment_id)
    for start in range(0, len(current), _COMMIT_EVERY):
        with index.write() as w:
            for record in current[start : start + _COMMIT_EVERY]:
                _index_record(w, files, classes, now, segment_id, record, report)


def _index_record(
    w: IndexWriter,
    files: SegmentFiles,
    classes: TrafficClasses,
    now: float,
    segment_id: int,
    record: ScannedRecord,
    report: RebuildReport,
) -> None:
    header = record.header
    if is_expired(header.expires_at_s, now):
        report.num_expired += 1
        return
    entry = _verified_entry(files, classes, segment_id, record)
    if entry is None:
        report.num_bad_records += 1
        return
    held = w.entry(entry.tenant, entry.key, entry.version)
    if held is not None and held.expires_at_s >= entry.expires_at_s:
        report.num_duplicates += 1
        return
    newer = [e for e in w.versions(entry.tenant, entry.key) if e.order > entry.order]
    if newer:
        report.num_duplicates += 1
        return
    replaced = w.put_entry(entry)
    report.num_duplicates += len(w.retire_older(entry)) + (replaced is not None)


def _verified_entry(
    files: SegmentFiles, classes: TrafficClasses, segment_id: int, record: ScannedRecord
) -> Entry | None:
    """The entry of an intact record whose shard passes every check, else None."""
    header = record.header
    try:
        shard = files.read_at(segment_id, record.offset + header.header_bytes, header.shard_bytes)
        parsed = verify_shard(shard)
    except (OSError, CodecError):
        return None
    if parsed.index != header.shard_index:
        return None
    return Entry(
        tenant=header.tenant,
        key=header.key,
        version=parsed.block_checksum,
        traffic_class=header.traffic_class,
        segment_id=segment_id,
        offset=record.offset,
        shard_bytes=header.shard_bytes,
        shard_checksum=int.from_bytes(shard[40:48], "little"),
        created_s=header.written_at_s,
        last_access_s=_last_access_s(classes, header),
        expires_at_s=header.expires_at_s,
        shard_index=parsed.index,
    )


def _last_access_s(classes: TrafficClasses, header: RecordHeader) -> float:
    """The access time the record's expiry implies (its write time for an unknown class)."""
    try:
        ttl_s = classes.ttl_s(header.traffic_class)
    except UnknownTrafficClass:
        return header.written_at_s
    if math.isinf(ttl_s):
        return header.written_at_s
    return max(header.written_at_s, header.expires_at_s - ttl_s)
