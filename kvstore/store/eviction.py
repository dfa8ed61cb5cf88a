"""Capacity: the byte limit, eviction in the configured order, and compaction of dead bytes.

The byte limit is the smaller of ``NodeConfig.max_bytes`` (0 = none) and the disk's free space
plus what the node already uses, so a disk that fills up (other data, a misjudged limit) makes
the node evict rather than fail. The index's allocated files (kvstore/store/index_backends.py
keeps a reserve allocated for it) count inside the limit: segment data may use the limit less
the index, and the watermarks apply to that. When a put would pass ``high_watermark`` of it,
the store expires, then evicts entries in the configured order (``[ttl] eviction_order``,
ttl/policy.py) until usage is under ``low_watermark``, and no further. Usage is the disk space
segments hold (:meth:`Evictor.held_bytes`: dead records count only where holes cannot be
punched), plus the put's own bytes, once:

    lru      least recently accessed first, whatever the class (the default: the simulator
             showed earliest expiry first starves short-TTL traffic; ttl/policy.py has figures)
    expiry   earliest expiry first (within a class that is least recently accessed first)

Each order is a range scan of its own index order (kvstore/store/index_codec.py), never a scan
of every entry. The last access is the one persisted in the index: a read hit counts once the
read-side state is flushed, which every write does first. Blocks a put re-puts (touches) are never
evicted to make room for that put's own group commit: the touch is an access.

**A block is evicted for its whole group, never one shard alone.** An evicted entry's key goes
into the node's delete log (a tombstone at the eviction's time, as a delete writes), in the
same transaction: every member of the group pulls the log and drops its shard of the block
(kvstore/node/tombstones.py), so the block reads as one clean miss everywhere instead of
living on with one shard less while the other members believe it whole; a repair cannot put
it back (the tombstone fences repair writes of it, kvstore/store/deletion.py). The node counts
the blocks it evicted (``EVICTED_BLOCKS``) besides the shards per class.

Evicting an entry leaves dead bytes in its segment, and its record is erased (a hole punched,
as a delete does): on a node whose limit is the disk, the blocks are free at once. Segments
with no live entry are deleted, and segments holding dead bytes are compacted (live records
carried forward, most dead bytes first) until usage is under the target, those whose copy fits
the disk's free space only. A copy that fails anyway (the disk filled meanwhile) evicts that
segment whole instead (its live entries go, the file is freed), which only ever deletes.
Entries of classes with an infinite TTL are never evicted in either order (they are pinned on
purpose, and LRU gives no reason to drop them before data that can expire): a put fails with
CapacityExhausted only when the space is held by them or by the request itself.

Single writer: callers hold the store's write lock.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Callable, Collection

from kvstore.config import NodeConfig
from kvstore.errors import CapacityExhausted
from kvstore.store.index import Index, IndexView, IndexWriter, class_counter
from kvstore.store.index_codec import Entry, SegmentMeta
from kvstore.store.reclaimer import Reclaimer
from kvstore.store.segments import SegmentFiles
from kvstore.store.store_stats import EVICTED_BLOCKS
from ttl.policy import EvictionOrder

log = logging.getLogger(__name__)

_EVICT_BATCH = 64
COPY_SLACK_BYTES = 64 << 10


def eviction_candidates(
    view: IndexView, order: EvictionOrder, start: bytes, limit: int
) -> list[tuple[bytes, Entry]]:
    """Up to ``limit`` (position, entry) in ``order`` from ``start``: entries that can expire,
    by ascending ``order.priority`` (the simulator's policy object: ttl/policy.py)."""
    if order is EvictionOrder.LRU:
        return view.evictable_by_access(start, limit)
    return view.evictable_by_expiry(start, limit)


class Evictor:
    """Keeps a node's segments under its byte limit."""

    def __init__(
        self,
        node: NodeConfig,
        index: Index,
        files: SegmentFiles,
        reclaimer: Reclaimer,
        order: EvictionOrder,
        erase: Callable[[], int] = lambda: 0,
    ) -> None:
        self._node = node
        self._index = index
        self._files = files
        self._reclaimer = reclaimer
        self._order = order
        self._erase = erase  # destroys queued records' bytes (kvstore/store/deletion.py)

    def capacity_bytes(self) -> int:
        """Bytes segment data may use: the byte limit (configured if set, and at most the disk's
        free space plus what the node holds) less the index's allocated files."""
        index_bytes = self._index.backend.allocated_bytes()
        free = shutil.disk_usage(self._files.directory).free
        configured = self._node.max_bytes if self._node.max_bytes > 0 else math.inf
        total = min(configured, free + self.held_bytes() + index_bytes)
        return int(max(0, total - index_bytes))

    def used_bytes(self) -> int:
        """Bytes of segment files, live and dead records."""
        with self._index.read() as view:
            return view.used_bytes()

    def held_bytes(self) -> int:
        """Disk space segment data holds: live records, plus dead ones where the filesystem
        cannot punch holes (there they hold their space until compaction).

        This, not :meth:`used_bytes`, is what the watermarks apply to. Counting punched dead
        records made eviction run on after the evicted records were already free: with one
        segment (one expiry window) compaction could not fit, ``used_bytes`` never fell, and a
        node evicted until the copy fit the disk, to under half its limit (issue 38). A punch
        widens over the blocks a record shares with erased neighbours (segments.py
        whole_zero_pages), so what stays allocated is only blocks shared with live records.
        """
        with self._index.read() as view:
            used = view.used_bytes()
            if not self._files.punches_holes:
                return used
            return used - sum(m.dead_bytes for m in view.segments())

    def make_room(self, need_bytes: int, now: float, keep: Collection[bytes] = ()) -> None:
        """Evict so that ``need_bytes`` more fit under the high watermark, or raise.

        Entries whose index key is in ``keep`` (blocks the caller is touching) are not evicted.
        """
        limit = self.capacity_bytes()
        if self.held_bytes() + need_bytes <= self._node.high_watermark * limit:
            return
        self.evict_to(self._node.low_watermark * limit - need_bytes, now, keep)
        used = self.held_bytes()
        if used + need_bytes > limit:
            raise CapacityExhausted(
                f"node {self._node.id}: {need_bytes} more bytes do not fit: {used} of {limit} "
                "bytes are used by data that cannot be evicted (classes with an infinite TTL "
                "or this request); raise max_bytes, add disk or send smaller batches"
            )

    def evict_if_over_high_watermark(self, now: float) -> None:
        """Evict down to the low watermark if usage passed the high one."""
        limit = self.capacity_bytes()
        if self.held_bytes() > self._node.high_watermark * limit:
            self.evict_to(self._node.low_watermark * limit, now)

    def evict_to(self, target_bytes: float, now: float, keep: Collection[bytes] = ()) -> None:
        """Expire, then evict by the eviction order until usage is under ``target_bytes``."""
        self._reclaimer.expire(now)
        while True:
            self._free_dead_space(target_bytes, now)
            used = self.held_bytes()
            if used <= target_bytes or not self._evict_entries(used - target_bytes, now, keep):
                return
            self._erase()  # the evicted records' disk blocks are free from here on

    def _evict_entries(self, excess_bytes: float, now: float, keep: Collection[bytes]) -> int:
        """Evict entries in eviction order until their records add up to ``excess_bytes``."""
        freed_bytes, num_evicted, position = 0, 0, b""
        with self._index.write() as w:
            while freed_bytes < excess_bytes:
                batch = eviction_candidates(w, self._order, position, _EVICT_BATCH)
                if not batch:
                    break
                position = batch[-1][0] + b"\x00"
                for entry in (e for _, e in batch if e.index_key not in keep):
                    _evict_one(w, entry, now)
                    freed_bytes += entry.record_bytes
                    num_evicted += 1
                    if freed_bytes >= excess_bytes:
                        break
        return num_evicted

    def _free_dead_space(self, target_bytes: float, now: float) -> None:
        """Delete empty segments, then compact those with most dead bytes until under target:
        only those whose live records fit the disk's free space (a copy that cannot fit would
        end in evicting the whole segment), or, when a copy fails anyway, evict them whole."""
        self._reclaimer.free_empty_segments()
        while self.held_bytes() > target_bytes:
            free_bytes = shutil.disk_usage(self._files.directory).free
            with self._index.read() as view:
                candidates = sorted(
                    (m for m in view.segments() if m.dead_bytes > 0 and _fits(m, free_bytes)),
                    key=_dead_bytes,
                    reverse=True,
                )
            if not any(self._free_segment(m.segment_id, now) for m in candidates):
                return

    def _free_segment(self, segment_id: int, now: float) -> bool:
        """Compact one segment, or evict it whole if the disk cannot take the copy; False if
        neither worked."""
        try:
            self._reclaimer.move_out([segment_id])
            return True
        except CapacityExhausted as exc:
            log.warning("compacting segment %d failed (%s): evicting it whole", segment_id, exc)
            return self.evict_segment(segment_id, now)

    def evict_segment(self, segment_id: int, now: float) -> bool:
        """Evict every live entry of one segment and free its file (deletes only); False if
        it holds entries that are never evicted (infinite TTL), which stay."""
        with self._index.write() as w:
            entries = w.in_segment(segment_id, 1 << 40)
            if any(math.isinf(e.expires_at_s) for e in entries):
                return False
            for entry in entries:
                _evict_one(w, entry, now)
        self._reclaimer.free_empty_segments()
        return True


def _evict_one(w: IndexWriter, entry: Entry, now: float) -> None:
    """Evict ``entry`` and, through the delete log, its block on every member of its group;
    its record's bytes are queued for erasing (a punched hole frees the disk blocks at once)."""
    if w.delete_entry(entry):
        w.queue_erase(entry)
    w.log_tombstone(entry.tenant, entry.key, now)
    w.add(EVICTED_BLOCKS, 1)
    w.add(class_counter(entry.traffic_class, "evicted"), 1)
    w.set_min(
        class_counter(entry.traffic_class, "youngest_evicted_age_s"), now - entry.last_access_s
    )


def _dead_bytes(meta: SegmentMeta) -> int:
    return meta.dead_bytes


def _fits(meta: SegmentMeta, free_bytes: int) -> bool:
    """Whether copying the segment's live records fits the disk, with room to spare for the
    index's own growth."""
    return meta.live_bytes + meta.live_bytes // 8 + COPY_SLACK_BYTES <= free_bytes
