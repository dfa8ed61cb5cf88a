"""Expiry and carry-forward: deleting expired entries and freeing whole segment files.

Expiry is a range scan of the index's expiry order up to ``now``: it never touches live
entries. After it, a segment whose window has passed holds only entries refreshed by read
hits. Those are *carried forward*: copied into the segment of their new window, then the old
file is deleted whole. We carry forward rather than rewrite on every hit so reads stay
read-only and cheap: a hit costs one small index update (batched, kvstore/store/read_state.py), and
only the few refreshed blocks of a passing window are ever copied. Compaction
(kvstore/store/eviction.py) moves records out of a segment the same way.

Single writer: callers hold the store's write lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvstore.store.index import Index, class_counter
from kvstore.store.index_codec import Entry
from kvstore.store.read_state import ReadState, quarantine
from kvstore.store.segment_appender import SegmentAppender, window_end_s
from kvstore.store.segments import SegmentFiles
from kvstore.store.shard_reader import ShardReader
from ttl.policy import is_expired

_SCAN_BATCH = 4096
_MOVE_BATCH = 256


class Reclaimer:
    """Deletes expired entries, retires passed windows and frees empty segments."""

    def __init__(
        self,
        index: Index,
        files: SegmentFiles,
        appender: SegmentAppender,
        reader: ShardReader,
        reads: ReadState,
        expiry_window_s: float,
    ) -> None:
        self._index = index
        self._files = files
        self._appender = appender
        self._reader = reader
        self._reads = reads
        self._expiry_window_s = expiry_window_s

    def expire(self, now: float) -> int:
        """Delete every expired entry: a range scan of the expiry order, live ones untouched."""
        num_expired = 0
        while True:
            with self._index.write() as w:
                batch = w.by_expiry(now + 1e-5, _SCAN_BATCH)
                expired = [e for e in batch if is_expired(e.expires_at_s, now)]
                for entry in expired:
                    w.delete_entry(entry)
                    w.add(class_counter(entry.traffic_class, "expired"), 1)
            num_expired += len(expired)
            if len(batch) < _SCAN_BATCH or len(expired) < len(batch):
                return num_expired

    def retire_windows(self, now: float) -> None:
        """Carry refreshed entries out of segments whose window has passed; delete those files."""
        with self._index.read() as view:
            passed = [
                m.segment_id
                for m in view.segments()
                if window_end_s(m.window_id, self._expiry_window_s) <= now
            ]
        if passed:
            self.move_out(passed)

    def free_empty_segments(self) -> None:
        """Delete segments without a live entry (the whole file goes at once); a segment that
        holds bytes no entry accounts for moves to quarantine/ instead
        (kvstore/store/index_rebuild.py).
        """
        with self._index.read() as view:
            empty = [m.segment_id for m in view.segments() if m.num_live == 0]
            quarantined = view.quarantined()
        if not empty:
            return
        self._appender.seal(empty)
        with self._index.write() as w:
            for segment_id in empty:
                w.delete_segment(segment_id)
                if segment_id in quarantined:
                    w.unmark_quarantined(segment_id)
        for segment_id in empty:
            if segment_id in quarantined:
                self._files.quarantine(segment_id, quarantined[segment_id])
            else:
                self._files.remove(segment_id)

    def move_out(self, segment_ids: Sequence[int]) -> None:
        """Copy the live records of these segments into open segments, then delete them."""
        self._appender.seal(segment_ids)
        for segment_id in segment_ids:
            while True:
                with self._index.read() as view:
                    batch = view.in_segment(segment_id, _MOVE_BATCH)
                if not batch:
                    break
                self._carry_forward(batch)
        self.free_empty_segments()

    def _carry_forward(self, entries: list[Entry]) -> None:
        """Re-append ``entries`` (with their latest TTL refresh) to their current window."""
        moves, unreadable = [], []
        for entry in entries:
            try:
                shard = self._reader.read_verified(entry)
            except FileNotFoundError:
                shard = None
            if shard is None:
                unreadable.append(entry)
            else:
                moves.append((self._reads.with_refresh(entry), shard))
        self._appender.append_and_commit(moves, also=partial(quarantine, corrupt=unreadable))
        self._reads.forget_corrupt(unreadable)
