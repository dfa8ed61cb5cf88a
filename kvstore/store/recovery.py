"""Start-up: lock the data directory, open (or rebuild) the index, make the files agree with it.

Opening the index (:func:`open_index`): lmdb files that cannot be opened or read (every page is
read once, every entry decoded) are moved aside to ``index.damaged-<time>/`` and a blank index
takes their place. A blank index next to segment files means the index was lost: it is rebuilt
from the segment records (kvstore/store/index_rebuild.py). An index of an older format is migrated
(kvstore/store/migration.py). Then the index is the commit point, so it is the truth and the files
are fixed to it:

    file longer than committed   a torn tail (crash mid-append, or a put that failed before its
                                 commit): truncated back to the committed end
    file shorter than committed  bytes lost on disk: entries past the file's end are dropped
                                 and counted as corrupt shards (a repair can store them again)
    file not in the index        an orphan (crash after creating it, before its commit): removed

"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import IndexUnusable, InvalidArgument
from kvstore.store.index import Index, IndexWriter
from kvstore.store.index_backends import Backend, LmdbBackend
from kvstore.store.index_codec import SegmentMeta
from kvstore.store.index_rebuild import rebuild_index
from kvstore.store.migration import migrate_index
from kvstore.store.segments import SegmentFiles
from kvstore.store.store_stats import CORRUPT_SHARDS
from ttl.policy import TrafficClasses

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


def open_index(
    path: Path,
    *,
    sync: bool,
    reserve_bytes: int,
    group_of: Callable[[bytes], int],
    backend: Backend | None = None,
) -> Index:
    """The index at ``path`` (or over ``backend``); damaged lmdb files are moved aside and a
    blank index opened in their place (:func:`recover` then rebuilds it)."""
    if backend is not None:
        return Index(backend, group_of)
    try:
        index = Index(LmdbBackend(path, sync=sync, reserve_bytes=reserve_bytes), group_of)
    except IndexUnusable as exc:
        move_index_aside(path, str(exc))
    else:
        try:
            index.backend.verify()
            return index
        except IndexUnusable as exc:
            index.close()
            move_index_aside(path, str(exc))
    return Index(LmdbBackend(path, sync=sync, reserve_bytes=reserve_bytes), group_of)


def move_index_aside(path: Path, why: str) -> Path:
    """Rename a damaged index directory (kept for inspection, never reused)."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    log.error("the index is unusable (%s): moved it to %s; rebuilding from segments", why, aside)
    return aside


def recover(
    index: Index,
    files: SegmentFiles,
    classes: TrafficClasses,
    expiry_window_s: float,
    now: float,
) -> int:
    """Rebuild, migrate, then check every segment against the index; return the next unused
    segment id."""
    with index.read() as view:
        lost = view.is_blank() and bool(files.ids_on_disk())
    if lost:
        rebuild_index(index, files, classes, expiry_window_s, now)
    else:
        migrate_index(index, files)
    index.verify()
    with index.write() as w:
        metas = w.segments()
        for meta in metas:
            _recover_segment(w, files, meta)
        next_segment_id = max([w.next_segment_id(), *(sid + 1 for sid in files.ids_on_disk())])
    orphans = files.ids_on_disk() - {m.segment_id for m in metas}
    for segment_id in sorted(orphans):
        # The index is intact, so an unregistered file is a put that never committed (crash
        # during an append) or a freed segment whose unlink a crash interrupted.
        log.warning("removing segment %d: not in the index (never committed, or freed)", segment_id)
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
