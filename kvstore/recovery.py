"""Start-up: lock the data directory, then make the segment files agree with the index.

The index is the commit point, so at start-up it is the truth and the files are fixed to it:

    file longer than committed   a torn tail (crash mid-append, or a put that failed before its
                                 commit): truncated back to the committed end
    file shorter than committed  bytes lost on disk: entries past the file's end are dropped
                                 and counted as corrupt shards (a repair can store them again)
    file not in the index        an orphan (crash after creating it, before its commit): removed

An index written before the last-access order existed gets it here, once (kvstore/index.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.index import Index, IndexWriter, SegmentMeta
from kvstore.segments import SegmentFiles
from kvstore.store_stats import CORRUPT_SHARDS

log = logging.getLogger(__name__)


def lock_data_dir(data_dir: Path) -> int:
    """Hold an exclusive lock on ``data_dir`` for this store's lifetime; return its fd.

    A second process on the same directory would truncate the first one's in-flight appends
    as torn tails at its start-up; the lock makes it fail first instead.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InvalidArgument(
            f"data_dir {data_dir} is in use by another node process; "
            "give every node its own data_dir"
        ) from None
    return fd


def recover(index: Index, files: SegmentFiles) -> int:
    """Check every segment against the index; return the next unused segment id."""
    with index.write() as w:
        if num_indexed := w.index_access_order():
            log.info("indexed %d entries by last access (an older index)", num_indexed)
        metas = w.segments()
        for meta in metas:
            _recover_segment(w, files, meta)
        next_segment_id = max([w.next_segment_id(), *(sid + 1 for sid in files.ids_on_disk())])
    orphans = files.ids_on_disk() - {m.segment_id for m in metas}
    for segment_id in sorted(orphans):
        log.warning("removing segment %d: never committed (crash during a put)", segment_id)
        files.remove(segment_id)
    with index.read() as view:
        log.info("recovered %d segments, %d bytes", len(metas), view.used_bytes())
    return next_segment_id


def _recover_segment(w: IndexWriter, files: SegmentFiles, meta: SegmentMeta) -> None:
    size = files.size(meta.segment_id) or 0
    if size > meta.committed_bytes:
        log.warning(
            "segment %d: truncating a torn tail of %d bytes",
            meta.segment_id,
            size - meta.committed_bytes,
        )
        files.truncate(meta.segment_id, meta.committed_bytes)
    elif size < meta.committed_bytes:
        _drop_lost_records(w, meta, size)


def _drop_lost_records(w: IndexWriter, meta: SegmentMeta, size: int) -> None:
    """The file is shorter than committed (lost on disk): entries past its end are gone."""
    in_segment = w.in_segment(meta.segment_id, 1 << 40)
    lost = [e for e in in_segment if e.offset + e.record_bytes > size]
    log.error(
        "segment %d is %d bytes, %d were committed: %d shards lost",
        meta.segment_id,
        size,
        meta.committed_bytes,
        len(lost),
    )
    for entry in lost:
        w.delete_entry(entry)
        w.add(CORRUPT_SHARDS, 1)
    w.set_committed_bytes(meta.segment_id, size)
