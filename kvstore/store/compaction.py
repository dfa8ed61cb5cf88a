"""Background compaction: segments mostly made of dead records are rewritten, so dead versions
stop counting against the node's capacity.

A record dies when its entry goes: a newer version of the key retired it, a delete, an
eviction, a shard found corrupt. Until its segment file is freed its bytes still count in
``used_bytes``, against ``max_bytes`` and the watermarks: 200 overwrites of one 4 MiB key
left 84 MB of segments for 0.4 MB live, and a hot rewritten key made the node evict other
tenants' blocks. Expiry frees whole files only when their window passes, and eviction
compacts only under pressure, so the upkeep tick compacts in the background as well::

    candidate   live bytes < COMPACT_LIVE_FRACTION of its committed bytes, and at least
                COMPACT_MIN_DEAD_BYTES dead (a small file is not worth a copy); the open
                segment of a window too (it is sealed first: new records go to a new file)
    order       most dead bytes first
    copy        its live records are carried forward into the open segment of their window
                (kvstore/store/reclaimer.py move_out: every record re-read and verified, one
                append and one index commit per batch), then the file is deleted whole
    rate        a token bucket of COMPACT_BYTES_PER_S of live bytes copied (real time); a
                copy may overdraw it, and the ticks after it wait until it refills

The policy (:func:`compaction_candidates`) is pure; :class:`Compactor` runs it in the store's
upkeep tick, under the store's write lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kvstore.errors import CapacityExhausted
from kvstore.store.index import Index
from kvstore.store.index_codec import SegmentMeta
from kvstore.store.reclaimer import Reclaimer
from kvstore.store.store_stats import COMPACTED_BYTES

log = logging.getLogger(__name__)

COMPACT_LIVE_FRACTION = 0.5
COMPACT_MIN_DEAD_BYTES = 4 << 20
COMPACT_BYTES_PER_S = 32 << 20
BURST_S = 2.0


def compaction_candidates(
    segments: Iterable[SegmentMeta],
    live_fraction: float = COMPACT_LIVE_FRACTION,
    min_dead_bytes: int = COMPACT_MIN_DEAD_BYTES,
) -> list[SegmentMeta]:
    """Segments worth compacting (see the module docstring), most dead bytes first."""
    worth = [
        m
        for m in segments
        if m.dead_bytes >= min_dead_bytes and m.live_bytes < live_fraction * m.committed_bytes
    ]
    return sorted(worth, key=lambda m: m.dead_bytes, reverse=True)


class Compactor:
    """Compacts candidate segments at a bounded rate of live bytes copied."""

    def __init__(
        self,
        index: Index,
        reclaimer: Reclaimer,
        bytes_per_s: float = COMPACT_BYTES_PER_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self._reclaimer = reclaimer
        self._bytes_per_s = bytes_per_s
        self._monotonic = monotonic
        self._tokens = bytes_per_s * BURST_S
        self._last_s = monotonic()

    def step(self) -> int:
        """Compact what the tokens allow now; return the dead bytes freed."""
        now_s = self._monotonic()
        burst = self._bytes_per_s * BURST_S
        self._tokens = min(burst, self._tokens + (now_s - self._last_s) * self._bytes_per_s)
        self._last_s = now_s
        with self._index.read() as view:
            candidates = compaction_candidates(view.segments())
        freed = 0
        for meta in candidates:
            if self._tokens <= 0:
                break
            try:
                self._reclaimer.move_out([meta.segment_id])
            except CapacityExhausted as exc:
                # The live records need room in a new segment, which a full disk does not
                # have (the append was undone). Expiry, eviction and deletes free space first;
                # the next tick tries again. Raising would skip the rest of every tick's upkeep.
                log.info("compaction waits for free space: %s", exc)
                break
            self._tokens -= meta.live_bytes
            freed += meta.dead_bytes
        if freed:
            with self._index.write() as w:
                w.add(COMPACTED_BYTES, freed)
        return freed
