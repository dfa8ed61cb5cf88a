"""The simulator's pass in pure Python: the reference of its semantics (``ttl.simulator``'s
module docstring), which the compiled loop (``ttl/simloop.c``) follows line for line and is
checked against (``tests/ttl/test_simloop.py``); it runs where the library is not built."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from operator import length_hint

import numpy as np

from ttl.policy import is_expired
from ttl.sim_counts import (
    ClassStats,
    ProgressFn,
    SimConfig,
    SimCounts,
    pass_counts,
    relative_end_s,
    relative_times,
)
from ttl.traces import Trace

_SCAN_CHUNK = 64  # block positions searched per C call in _find_live
VISIT_CHUNK = 4096  # visits whose block ids become one Python list at a time
_WINDOW = 8192  # block ids per list that expiry and eviction read queue entries from


class PythonPass:
    """Simulation state of one pass.

    Visits are the trace's rows that have blocks, in time order. Per block: its class (-1 =
    not resident) and ``block_entry = v * num_classes + k``, the queue entry (visit ``v`` in
    class ``k``'s queue) that holds its last touch. Per class: a queue of visits in time
    order, consumed lazily by expiry and eviction from ``heads``/``cursors`` (first entry, and
    first block in it, not yet consumed); an entry stands for the blocks whose ``block_entry``
    still names it. ``next_expiry_s`` is at most the expiry of every queue's head, so a visit
    before it has nothing to expire.
    """

    def __init__(self, trace: Trace, config: SimConfig) -> None:
        self.trace, self.config = trace, config
        lengths = np.diff(trace.block_offsets)
        visits = np.flatnonzero(lengths)
        self.visit_rows = visits
        self.starts = trace.block_offsets[visits]
        self.lengths = lengths[visits]
        self.visit_times = relative_times(trace)[visits]
        self.times: list[float] = self.visit_times.tolist()
        self.classes = trace.class_ids[visits].astype(np.int64)
        self.ttl_s = [config.classes.ttl_s(name) for name in trace.class_names]
        self.num_classes = num_classes = len(trace.class_names)
        self.block_class = [-1] * trace.num_blocks
        self.block_entry = [-1] * trace.num_blocks
        self.queues: list[list[int]] = [[] for _ in range(num_classes)]
        self.heads = [0] * num_classes
        self.cursors = [0] * num_classes  # position in the trace's block ids
        self.windows: list[list[int]] = [[] for _ in range(num_classes)]
        self.window_starts = [0] * num_classes
        self.front_priority: list[float | None] = [None] * num_classes  # of each front entry
        self.start_list: list[int] = self.starts.tolist()
        self.length_list: list[int] = self.lengths.tolist()
        self.live_by_class = [0] * num_classes
        self.live = 0
        self.miss_visits: list[int] = []
        self.miss_indexes: list[int] = []  # in the visit's own blocks
        self.miss_inserted: list[int] = []
        self.evictions: list[tuple[int, int, int]] = []  # visit, class, blocks
        self.expiries: list[tuple[float, int, int]] = []  # instant, class, blocks
        self.stats = [ClassStats() for _ in range(num_classes)]  # deaths; the rest in result()
        self.end_s = relative_end_s(trace)
        self.window_start_s = config.warmup_fraction * self.end_s
        self.counting = False
        self.next_expiry_s = math.inf

    def run(self, progress: ProgressFn | None) -> None:
        """Every visit, the window's start between them, then expiry up to the trace's end."""
        edge = int(np.searchsorted(self.visit_times, self.window_start_s, side="left"))
        done = 0
        for begin, end in ((0, edge), (edge, len(self.times))):
            if begin == edge:
                self.start_window()
            for chunk in range(begin, end, VISIT_CHUNK):
                done = self.visit(chunk, min(chunk + VISIT_CHUNK, end), done)
                if progress is not None:
                    progress(done)
        self.live -= self.expire(self.end_s)

    # --- the hot loop ---------------------------------------------------------------------

    def visit(self, begin: int, end: int, done: int) -> int:
        """Visits ``[begin, end)``; returns the block accesses done. The dense hot path of this
        module: per block access only list indexing and compares on locals; per visit a few
        more around the two loops."""
        ids, rows, num_accesses = self.chunk(begin, end)
        block_class, block_entry, queues = self.block_class, self.block_entry, self.queues
        live_by_class, touch_foreign = self.live_by_class, self.touch_foreign
        miss_visit, miss_index = self.miss_visits.append, self.miss_indexes.append
        miss_inserted = self.miss_inserted.append
        capacity = self.config.capacity_blocks
        capacity = sys.maxsize if capacity is None else capacity
        live, next_expiry_s, position = self.live, self.next_expiry_s, 0
        for v, now, c, entry, expires_s, n in rows:
            if is_expired(next_expiry_s, now):
                live -= self.expire(now)
                next_expiry_s = self.next_expiry_s
            queues[c].append(v)
            if expires_s < next_expiry_s:  # queue c was empty: nothing else expires sooner
                next_expiry_s = expires_s
            blocks = iter(ids[position : position + n])
            position += n
            for b in blocks:  # the prefix hit: leading resident blocks, touched
                k = block_class[b]
                if k == c:
                    block_entry[b] = entry
                elif k < 0:
                    break
                else:
                    touch_foreign(b, k, v)
            else:
                continue  # every block hit: nothing inserted
            miss_visit(v)
            miss_index(n - length_hint(blocks) - 1)
            block_class[b] = c
            block_entry[b] = entry
            num_new = 1
            for b in blocks:  # the rest: insert missing blocks, touch resident ones
                k = block_class[b]
                if k == c:
                    block_entry[b] = entry
                elif k < 0:
                    block_class[b] = c
                    block_entry[b] = entry
                    num_new += 1
                else:
                    touch_foreign(b, k, v)
            miss_inserted(num_new)
            live_by_class[c] += num_new
            live += num_new
            if live > capacity:
                self.next_expiry_s = next_expiry_s
                self.evict(live - capacity, now, v)
                live = capacity
        self.live, self.next_expiry_s = live, next_expiry_s
        return done + num_accesses

    def chunk(self, begin: int, end: int) -> tuple[list[int], Iterator[tuple], int]:
        """Visits ``[begin, end)`` as Python values: their block ids, per visit ``(visit, time,
        class, queue entry, expiry instant, blocks)``, and their number of block accesses."""
        first, last = int(self.starts[begin]), int(self.starts[end - 1] + self.lengths[end - 1])
        ids = self.trace.block_ids[first:last].tolist()
        classes = self.classes[begin:end]
        entries = (np.arange(begin, end) * self.num_classes + classes).tolist()
        ttl_s = np.array(self.ttl_s)[classes] if len(self.ttl_s) else classes
        expiries = (self.visit_times[begin:end] + ttl_s).tolist()
        rows = zip(
            range(begin, end), self.times[begin:end], classes.tolist(), entries, expiries,
            self.lengths[begin:end].tolist(), strict=True,
        )  # fmt: skip
        return ids, rows, last - first

    # --- per visit -------------------------------------------------------------------------

    def start_window(self) -> None:
        """Start counting: the blocks resident now count from the window's start."""
        self.counting = True
        for stats, live in zip(self.stats, self.live_by_class, strict=True):
            stats.block_seconds = -live * self.window_start_s

    def touch_foreign(self, b: int, k: int, v: int) -> None:
        """Visit ``v`` touched block ``b`` of class ``k`` (not its own): queue it under ``k``.
        Queue ``k`` holds the block, so its head expires no later: ``next_expiry_s`` stands."""
        self.block_entry[b] = v * self.num_classes + k
        queue = self.queues[k]
        if queue[-1] != v:
            queue.append(v)

    # --- expiry and eviction ---------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop every block whose expiry instant is <= now; return how many."""
        num_expired = 0
        next_expiry_s = math.inf
        times, heads, queues = self.times, self.heads, self.queues
        for k, ttl_s in enumerate(self.ttl_s):
            queue = queues[k]
            while heads[k] < len(queue):
                expires_at_s = times[queue[heads[k]]] + ttl_s
                if not is_expired(expires_at_s, now):
                    next_expiry_s = min(next_expiry_s, expires_at_s)
                    break
                num_expired += self.drop_front(k, expires_at_s)
        self.next_expiry_s = next_expiry_s
        return num_expired

    def drop_front(self, k: int, expires_at_s: float) -> int:
        """Expire the live blocks of queue ``k``'s front entry, then pop it."""
        blocks, position, end, entry = self.front(k)
        block_class, block_entry = self.block_class, self.block_entry
        num = 0
        while position < end:
            b = blocks[position]
            if block_entry[b] == entry:
                block_class[b] = block_entry[b] = -1
                num += 1
                position += 1
            else:
                position = _find_live(blocks, position + 1, end, entry, block_entry)
        self.pop_front(k)
        if num:
            self.expiries.append((expires_at_s, k, num))
            self.record_deaths(k, num, expires_at_s, evicted=False)
        return num

    def evict(self, num: int, now: float, v: int) -> None:
        """Evict ``num`` resident blocks, smallest priority first (module docstring, rule 4)."""
        block_class, block_entry = self.block_class, self.block_entry
        while num:
            k = self.lowest_priority_class()  # leaves queue k's cursor on a live block
            blocks, position, end, entry = self.front(k)
            wanted = num
            while num and position < end:  # one entry: one priority
                b = blocks[position]
                if block_entry[b] == entry:
                    block_class[b] = block_entry[b] = -1
                    num -= 1
                    position += 1
                else:
                    position = _find_live(blocks, position + 1, end, entry, block_entry)
            self.cursors[k] = self.window_starts[k] + position
            self.evictions.append((v, k, wanted - num))
            self.record_deaths(k, wanted - num, now, evicted=True)

    def lowest_priority_class(self) -> int:
        """The class whose next live block has the smallest eviction priority.

        A queue's priorities never fall from front to back, so the priority of a class's front
        entry bounds that of its first live block: only the winner's front needs checking."""
        live_by_class, priorities = self.live_by_class, self.front_priority
        while True:
            best_k, best_priority = -1, math.inf
            for k in range(self.num_classes):
                if not live_by_class[k]:
                    continue
                priority = priorities[k]
                if priority is None:
                    last_s = self.times[self.queues[k][self.heads[k]]]
                    priority = self.config.eviction.priority(last_s, last_s + self.ttl_s[k])
                    priorities[k] = priority
                if best_k < 0 or priority < best_priority:
                    best_k, best_priority = k, priority
            assert best_k >= 0, "evict() with no resident block: the live count is off"
            blocks, position, end, entry = self.front(best_k)
            if position < end and self.block_entry[blocks[position]] == entry:
                return best_k
            self.seek_live(best_k)  # moved on: its priority may have risen

    def seek_live(self, k: int) -> None:
        """Move queue ``k``'s head and cursor to its first live block (it has one)."""
        while True:
            blocks, position, end, entry = self.front(k)
            position = _find_live(blocks, position, end, entry, self.block_entry)
            if position < end:
                self.cursors[k] = self.window_starts[k] + position
                return
            self.pop_front(k)

    def front(self, k: int) -> tuple[list[int], int, int, int]:
        """Queue ``k``'s front entry: a list holding its blocks, the cursor's and the entry's
        end positions in that list, and the entry. The list is a window of the trace's block
        ids (``_WINDOW`` accesses from the entry's start), so skipping dead entries costs no
        numpy call per entry."""
        v = self.queues[k][self.heads[k]]
        start = self.start_list[v]
        end = start + self.length_list[v]
        if self.cursors[k] < start:
            self.cursors[k] = start
        window_start = self.window_starts[k]
        blocks = self.windows[k]
        if start < window_start or end > window_start + len(blocks):
            stop = max(start + _WINDOW, end)
            blocks = self.windows[k] = self.trace.block_ids[start:stop].tolist()
            window_start = self.window_starts[k] = start
        return blocks, self.cursors[k] - window_start, end - window_start, v * self.num_classes + k

    def pop_front(self, k: int) -> None:
        self.heads[k] += 1
        self.front_priority[k] = None
        if self.heads[k] > 4096 and self.heads[k] * 2 > len(self.queues[k]):
            del self.queues[k][: self.heads[k]]  # keep queue memory proportional to live data
            self.heads[k] = 0

    def record_deaths(self, k: int, num: int, death_s: float, evicted: bool) -> None:
        self.live_by_class[k] -= num
        if not self.counting:
            return
        stats = self.stats[k]
        stats.block_seconds += num * max(death_s, self.window_start_s)
        if evicted:
            stats.evicted_blocks += num
        elif death_s >= self.window_start_s:  # not those that died before the window
            stats.expired_blocks += num

    # --- result ----------------------------------------------------------------------------

    def counts(self) -> SimCounts:
        """The pass's counts, with requests and positions in the whole trace (numpy, once)."""
        misses = np.column_stack([
            np.asarray(self.miss_visits, np.int64),
            np.asarray(self.miss_indexes, np.int64),
            np.asarray(self.miss_inserted, np.int64),
        ])  # fmt: skip
        return pass_counts(
            self.trace, self.visit_rows, self.starts, misses,
            np.asarray(self.evictions, np.int64).reshape(-1, 3),
            np.asarray(self.expiries, np.float64).reshape(-1, 3), self.stats,
        )  # fmt: skip


def _find_live(blocks: list[int], start: int, end: int, entry: int, block_entry: list[int]) -> int:
    """The first position in ``[start, end)`` whose block's live entry is ``entry``, else end.

    Stale positions (blocks touched again later) are most of what expiry and eviction walk
    over, so the search runs in C: ``map`` fetches a chunk of entries, ``list.index`` finds.
    """
    if start < end and block_entry[blocks[start]] == entry:
        return start  # the common case when a run of live blocks is being consumed
    get = block_entry.__getitem__
    while start < end:
        chunk = list(map(get, blocks[start : min(start + _SCAN_CHUNK, end)]))
        if entry in chunk:
            return start + chunk.index(entry)
        start += len(chunk)
    return end
