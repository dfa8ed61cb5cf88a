"""Appending records to segments grouped by expiry window, then committing their index entries.

Segments are grouped by expiry window (``TTLConfig.expiry_window_s``): a shard goes to the open
segment of the window its ``expires_at_s`` falls in, so expiry frees whole files. A window's
open segment is sealed and a new one started when a record would take it past
``segment_max_bytes``.

One append batch (a group commit of puts, or records carried forward)::

    place every record at the end of the open segment of its window (new segments as needed)
    write each touched segment's records with one pwritev (header, shard, header, shard, ...)
    fsync each touched segment once
    commit one index transaction: new segments, committed ends, every entry  <- commit point
    (any failure before the commit cuts every touched segment back to its committed end and
     removes new ones: nothing becomes visible, no trace is left)

Single writer: callers hold the store's write lock.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvstore.store.index import Index, IndexWriter
from kvstore.store.index_codec import Entry, tenant_hash
from kvstore.store.segments import RECORD_FORMAT, SegmentFiles, pack_record_header

INF_WINDOW = 1 << 62  # window of shards that never expire: never retired


def window_id(expires_at_s: float, expiry_window_s: float) -> int:
    """The expiry window an expiry time falls in (``INF_WINDOW`` for never)."""
    if math.isinf(expires_at_s):
        return INF_WINDOW
    return math.floor(expires_at_s / expiry_window_s)


def window_end_s(window: int, expiry_window_s: float) -> float:
    """When every shard originally placed in ``window`` has expired."""
    return math.inf if window == INF_WINDOW else (window + 1) * expiry_window_s


@dataclass
class _AppendPlan:
    """Segments written by one append batch: new ones and the end offset of each touched one."""

    new_segment_to_window: dict[int, int] = field(default_factory=dict)
    segment_to_end: dict[int, int] = field(default_factory=dict)
    window_to_open: dict[int, tuple[int, int]] = field(default_factory=dict)


class SegmentAppender:
    """The open segment of each window, and the append-then-commit of records into them."""

    def __init__(
        self,
        index: Index,
        files: SegmentFiles,
        *,
        expiry_window_s: float,
        segment_max_bytes: int,
        next_segment_id: int,
    ) -> None:
        self._index = index
        self._files = files
        self._expiry_window_s = expiry_window_s
        self._segment_max_bytes = segment_max_bytes
        self._next_segment_id = next_segment_id
        self._window_to_open: dict[int, tuple[int, int]] = {}  # -> (segment id, committed end)

    def append_and_commit(
        self,
        items: Sequence[tuple[Entry, bytes | memoryview]],
        also: Callable[[IndexWriter], None] | None = None,
    ) -> None:
        """Append ``(entry, shard)`` records, fsync, then commit their entries in one transaction.

        ``also`` makes further changes in the same transaction (re-put refreshes, dropping
        shards found unreadable while moving records).
        """
        plan = _AppendPlan(window_to_open=dict(self._window_to_open))
        try:
            placed = self._append_all(plan, items)
            self._files.sync(plan.segment_to_end)
            with self._index.write() as w:
                _register(w, plan)
                w.put_entries(placed)
                if also is not None:
                    also(w)
        except BaseException:
            self._undo_appends(plan)
            raise
        self._install(plan)

    def seal(self, segment_ids: Iterable[int]) -> None:
        """Stop appending to these segments (they are about to be moved out or deleted)."""
        doomed = set(segment_ids)
        self._window_to_open = {
            w: (sid, end) for w, (sid, end) in self._window_to_open.items() if sid not in doomed
        }
        for segment_id in doomed:
            self._files.close_writer(segment_id)

    def _append_all(
        self, plan: _AppendPlan, items: Sequence[tuple[Entry, bytes | memoryview]]
    ) -> list[Entry]:
        """Place every record, then write each segment's records with one ``pwritev``
        (records placed in one segment by one batch are contiguous); the entries pointing at
        them."""
        placed: list[Entry] = []
        segment_to_chunks: dict[int, list[bytes | memoryview]] = {}
        for entry, shard in items:
            entry, header = self._place(plan, entry, shard)
            segment_to_chunks.setdefault(entry.segment_id, []).extend((header, shard))
            placed.append(entry)
        segment_to_start = {}
        for entry in placed:
            segment_to_start.setdefault(entry.segment_id, entry.offset)
        for segment_id, chunks in segment_to_chunks.items():
            self._files.append(segment_id, segment_to_start[segment_id], chunks)
        return placed

    def _place(
        self, plan: _AppendPlan, entry: Entry, shard: bytes | memoryview
    ) -> tuple[Entry, bytes]:
        """Where one record goes (always the current record format): the entry pointing at
        it, and its record header."""
        if entry.record_format != RECORD_FORMAT or entry.shard_bytes != len(shard):
            entry = replace(entry, record_format=RECORD_FORMAT, shard_bytes=len(shard))
        window = window_id(entry.expires_at_s, self._expiry_window_s)
        size = entry.record_bytes
        segment_id, end = plan.window_to_open.get(window, (0, 0))
        if segment_id == 0 or (end > 0 and end + size > self._segment_max_bytes):
            segment_id, end = self._next_segment_id, 0
            self._next_segment_id += 1
            plan.new_segment_to_window[segment_id] = window
        header = pack_record_header(
            entry.key,
            tenant_hash(entry.tenant),
            len(shard),
            tenant=entry.tenant,
            traffic_class=entry.traffic_class,
            shard_index=entry.shard_index,
            written_at_s=entry.created_s,
            expires_at_s=entry.expires_at_s,
        )
        plan.window_to_open[window] = (segment_id, end + size)
        plan.segment_to_end[segment_id] = end + size
        return entry.placed(segment_id, end), header

    def _undo_appends(self, plan: _AppendPlan) -> None:
        """Cut every touched segment back to its committed end: the batch leaves no trace."""
        committed = {sid: end for sid, end in self._window_to_open.values()}
        for segment_id in plan.segment_to_end:
            if segment_id in plan.new_segment_to_window:
                self._files.remove(segment_id)
            else:
                with contextlib.suppress(OSError):
                    self._files.truncate(segment_id, committed[segment_id])

    def _install(self, plan: _AppendPlan) -> None:
        """After a commit: the plan's open segments become the store's; close sealed ones."""
        still_open = {sid for sid, _ in plan.window_to_open.values()}
        for segment_id, _ in self._window_to_open.values():
            if segment_id not in still_open:
                self._files.close_writer(segment_id)
        self._window_to_open = plan.window_to_open


def _register(w: IndexWriter, plan: _AppendPlan) -> None:
    for segment_id, window in plan.new_segment_to_window.items():
        w.add_segment(segment_id, window)
    for segment_id, end in plan.segment_to_end.items():
        w.set_committed_bytes(segment_id, end)
