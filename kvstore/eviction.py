"""Capacity: the byte limit, eviction by earliest expiry, and compaction of dead bytes.

The byte limit is ``NodeConfig.max_bytes`` or, if 0, the disk's free space plus what the
segments already use. When a put would pass ``high_watermark`` of it, the store expires, then
evicts entries in ``EvictionOrder.EXPIRY`` order (earliest expiry first; within a class that is
least recently accessed first) until usage is under ``low_watermark``. Evicting an entry leaves
dead bytes in its segment; segments with no live entry are deleted, and segments holding dead
bytes are compacted (live records carried forward, most dead bytes first) until usage is under
the target. Entries of classes with an infinite TTL are never evicted: a put fails with
CapacityExhausted only when the space is held by them or by the request itself.

Single writer: callers hold the store's write lock.
"""

from __future__ import annotations

import math
import shutil

from kvstore.config import NodeConfig
from kvstore.errors import CapacityExhausted
from kvstore.index import Entry, Index, IndexWriter, SegmentMeta, class_counter
from kvstore.reclaimer import Reclaimer
from kvstore.segments import SegmentFiles
from ttl.policy import EvictionOrder

# The store's eviction policy; the simulator uses the same object (ttl/policy.py).
EVICTION_ORDER = EvictionOrder.EXPIRY
assert EVICTION_ORDER.priority(0.0, 1.0) == 1.0, "the expiry index orders by expires_at_s"
_EVICT_BATCH = 64


class Evictor:
    """Keeps a node's segments under its byte limit."""

    def __init__(
        self, node: NodeConfig, index: Index, files: SegmentFiles, reclaimer: Reclaimer
    ) -> None:
        self._node = node
        self._index = index
        self._files = files
        self._reclaimer = reclaimer

    def capacity_bytes(self) -> int:
        """The byte limit: configured, or the disk's free space plus what segments use."""
        if self._node.max_bytes > 0:
            return self._node.max_bytes
        free = shutil.disk_usage(self._files.directory).free
        return free + self.used_bytes()

    def used_bytes(self) -> int:
        """Bytes of segment files, live and dead records."""
        with self._index.read() as view:
            return view.used_bytes()

    def make_room(self, need_bytes: int, now: float) -> None:
        """Evict so that ``need_bytes`` more fit under the high watermark, or raise."""
        limit = self.capacity_bytes()
        if self.used_bytes() + need_bytes <= self._node.high_watermark * limit:
            return
        self.evict_to(self._node.low_watermark * limit - need_bytes, now)
        used = self.used_bytes()
        if used + need_bytes > limit:
            raise CapacityExhausted(
                f"node {self._node.id}: {need_bytes} more bytes do not fit: {used} of {limit} "
                "bytes are used by data that cannot be evicted (classes with an infinite TTL "
                "or this request); raise max_bytes, add disk or send smaller batches"
            )

    def evict_if_over_high_watermark(self, now: float) -> None:
        """Evict down to the low watermark if usage passed the high one."""
        limit = self.capacity_bytes()
        if self.used_bytes() > self._node.high_watermark * limit:
            self.evict_to(self._node.low_watermark * limit, now)

    def evict_to(self, target_bytes: float, now: float) -> None:
        """Expire, then evict by the eviction order until usage is under ``target_bytes``."""
        self._reclaimer.expire(now)
        while True:
            self._free_dead_space(target_bytes)
            used = self.used_bytes()
            if used <= target_bytes or not self._evict_entries(used - target_bytes, now):
                return

    def _evict_entries(self, excess_bytes: float, now: float) -> int:
        """Evict entries in eviction order until their records add up to ``excess_bytes``."""
        freed_bytes, num_evicted = 0, 0
        with self._index.write() as w:
            while freed_bytes < excess_bytes:
                batch = w.by_expiry(math.inf, _EVICT_BATCH)
                for entry in batch:
                    _evict_one(w, entry, now)
                    freed_bytes += entry.record_bytes
                    num_evicted += 1
                    if freed_bytes >= excess_bytes:
                        break
                if not batch:
                    break
        return num_evicted

    def _free_dead_space(self, target_bytes: float) -> None:
        """Delete empty segments, then compact those with most dead bytes until under target."""
        self._reclaimer.free_empty_segments()
        while self.used_bytes() > target_bytes:
            with self._index.read() as view:
                candidates = [m for m in view.segments() if m.dead_bytes > 0]
            if not candidates:
                return
            self._reclaimer.move_out([max(candidates, key=_dead_bytes).segment_id])


def _evict_one(w: IndexWriter, entry: Entry, now: float) -> None:
    w.delete_entry(entry)
    w.add(class_counter(entry.traffic_class, "evicted"), 1)
    w.set_min(
        class_counter(entry.traffic_class, "youngest_evicted_age_s"), now - entry.last_access_s
    )


def _dead_bytes(meta: SegmentMeta) -> int:
    return meta.dead_bytes
