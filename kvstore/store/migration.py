"""Start-up migration of an index of format 1 to format 2 (kvstore/store/index_codec.py), and the
rewrite of format-1 segment records into format 2 (kvstore/store/segments.py).

Index format 1 entries lack the record format and the shard index, and format 1 had no
``by_group`` order (the repair's listing). Format 1 also kept every version a key was ever
overwritten with; a read returned all of them, so 150 overwrites of a 4 MiB block made one read
fetch 600 MiB. :func:`migrate_index` rewrites every entry in format 2 in ONE index transaction
(all or nothing: a crash leaves format 1, and the next start-up migrates again), reads each
shard index from its shard header (48 bytes per entry), and keeps only the newest version of
each key.

Records are not moved by the index migration: format-1 records stay readable where they are.
A lost index could not be rebuilt from them, though (they name no tenant, class or expiry), so
:func:`rewrite_legacy_segments` carries the live records of segments written before the
migration into new format-2 segments, a few segments per upkeep tick, until none is left.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from erasure.shard import HEADER_BYTES
from erasure.shard import MAGIC as SHARD_MAGIC
from kvstore.store.index import (
    CURRENT_INDEX_FORMAT,
    INDEX_FORMAT,
    RETIRED_VERSIONS,
    Index,
    IndexWriter,
)
from kvstore.store.index_codec import Entry, decode_entry_v1
from kvstore.store.reclaimer import Reclaimer
from kvstore.store.segments import LEGACY_HEADER_BYTES, SegmentFiles

log = logging.getLogger(__name__)

LEGACY_SEGMENTS_BELOW = "node/legacy_segments_below"  # segments under this id may hold KVR1
SHARD_INDEX_OFFSET = 8  # erasure/shard.py header layout
_BATCH = 4096


def migrate_index(index: Index, files: SegmentFiles) -> int:
    """Bring the index to the current format; return how many entries were migrated."""
    with index.write() as w:
        if w.index_format() >= CURRENT_INDEX_FORMAT:
            return 0
        if w.is_blank():
            w.set_counter(INDEX_FORMAT, CURRENT_INDEX_FORMAT)
            return 0
        num_migrated, num_retired, start = 0, 0, b""
        versions: list[Entry] = []  # of the key being migrated (entries are in key order)
        while items := w.legacy_items(start, _BATCH):
            for index_key, value in items:
                entry = _with_shard_index(decode_entry_v1(index_key, value), files)
                if versions and versions[0].index_key[:24] != index_key[:24]:
                    num_retired += _keep_newest(w, versions)
                    versions = []
                versions.append(entry)
                num_migrated += 1
            start = items[-1][0] + b"\x00"
        if versions:
            num_retired += _keep_newest(w, versions)
        w.add(RETIRED_VERSIONS, num_retired)
        w.set_counter(LEGACY_SEGMENTS_BELOW, w.next_segment_id())
        w.set_counter(INDEX_FORMAT, CURRENT_INDEX_FORMAT)
    log.warning(
        "migrated the index to format %d: %d entries, %d older versions retired",
        CURRENT_INDEX_FORMAT,
        num_migrated,
        num_retired,
    )
    return num_migrated


def _with_shard_index(entry: Entry, files: SegmentFiles) -> Entry:
    """The entry with the shard index its shard header names (0 if it cannot be read: the
    next read or scrub then finds the record corrupt, as before the migration)."""
    try:
        head = files.read_at(entry.segment_id, entry.offset + LEGACY_HEADER_BYTES, HEADER_BYTES)
    except OSError:
        return entry
    if head[:4] != SHARD_MAGIC or len(head) < HEADER_BYTES:
        return entry
    return replace(entry, shard_index=head[SHARD_INDEX_OFFSET])


def _keep_newest(w: IndexWriter, versions: list[Entry]) -> int:
    """Rewrite the newest version of one key in format 2, drop the rest; return #dropped."""
    newest = max(versions, key=lambda e: e.order)
    for entry in versions:
        if entry is newest:
            w.replace_legacy_entry(entry)
        else:
            w.delete_legacy_entry(entry)
    return len(versions) - 1


def rewrite_legacy_segments(index: Index, reclaimer: Reclaimer, max_segments: int) -> int:
    """Carry up to ``max_segments`` segments that may hold format-1 records into format-2
    segments; return how many are left (0: done, the marker is dropped)."""
    with index.read() as view:
        below = int(view.counter(LEGACY_SEGMENTS_BELOW) or 0)
        legacy = [m.segment_id for m in view.segments() if m.segment_id < below]
    if below and not legacy:
        with index.write() as w:
            w.set_counter(LEGACY_SEGMENTS_BELOW, 0)
        log.info("every segment record is in the current format")
    if legacy:
        reclaimer.move_out(legacy[:max_segments])
    return max(0, len(legacy) - max_segments)
