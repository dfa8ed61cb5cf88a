"""The simulator core: a request trace through the store's own TTL and capacity policies.

Semantics (docs/simulator.md quotes this list):

1. Requests are replayed in time order (ties keep trace order). At request time ``t`` every
   block whose expiry instant is ``<= t`` is gone first (``ttl.policy.is_expired``): a block
   touched exactly at its expiry is a miss and is inserted again as a new block.
2. Prefix hit: the leading resident blocks of the request. The first missing block ends the
   hit; resident blocks after it do not count (the engine recomputes everything after the
   first miss). Block ids name a block together with its prefix (see ``ttl.traces``).
3. After the lookup every block of the request is inserted or touched. A touch sets the
   block's last access to ``t``; the TTL counts from the last access. An inserted block takes
   the request's traffic class and keeps it: a hit from another class refreshes it with its
   own class's TTL, as the store does. ``expires_at = last_access + ttl(class)``; an infinite
   TTL never expires.
4. Capacity is a number of resident blocks (bytes are converted by the caller), enforced
   after each request's inserts, as a store that writes a request's blocks and then evicts
   down to its limit: while over capacity, the block with the smallest
   ``EvictionOrder.priority`` goes (``LRU``: least recently accessed first, the store's
   default; ``EXPIRY``: earliest expiry first; in both a block that never expires goes last).
   Ties go to the lower class index, then to the block touched earlier, then to the one
   earlier in its request. The request's own blocks are candidates too: under ``EXPIRY`` a
   block just touched by a short-TTL class can go before older blocks of a long-TTL class.
5. Warm-up: requests before ``start + warmup_fraction x span`` are simulated but not counted;
   footprint is measured over the counted window only.

Metrics, per traffic class and ``all``: hit metrics by the class of the request, footprint by
the class of the block. ``blocks`` = block accesses, ``block_hit_ratio`` = hit blocks / blocks.
Block ``i`` of a request with ``L`` input tokens weighs ``min(B, L - i*B)`` tokens (at least 0);
``tokens`` sums the weights, ``tokens_saved`` (prefill tokens saved) sums them over hit blocks,
``token_hit_ratio = tokens_saved / tokens``. ``peak_blocks`` is the most resident blocks after
any counted request; ``block_seconds`` integrates resident blocks over the window
(``mean_blocks = block_seconds / window_s``; expired blocks stop counting at their expiry
instant, evicted ones when evicted). ``written_blocks`` are the blocks after the prefix hit
(the engine computes them and writes them back, resident or not); ``peak_hit_blocks_per_s``
and ``peak_written_blocks_per_s`` are the busiest ``rate_window_s`` of the counted window
(whole buckets from its start; the whole window when it is shorter than one bucket), the read
and write load a planner sizes bandwidth for.

Partitions. A pass over part of the block space (a ``Trace`` whose rows are one placement
group's requests, with ``request_ids``: ``ttl.partition`` builds them) yields ``SimCounts``
that add up exactly: residency never depends on hits (every block of a request is touched or
inserted either way), so each partition evolves on its own; a request's prefix hit is the
earliest first-miss position over the partitions, and every other count adds up
(``CountsTotal``).

A pass visits only the requests that have blocks in it, and expires lazily: at a visit, every
queued entry whose expiry instant has passed goes. Resident counts are not kept per request:
a pass records where they change (inserts and evictions at their request, expiries at their
instant) and ``CountsTotal`` rebuilds every request's counts from those changes with one
cumulative sum, so a partition costs its own accesses and its own requests, not the trace's.

The core is pure: no clock, no I/O. The pass is one dense loop: dense int block ids in flat
arrays, and per class a queue of *visits* in time order (the class's TTL is fixed, so time
order is expiry order and LRU order) that expiry and eviction consume lazily; a block's live
entry is the visit that touched it last. Per access the loop does one read and one write
(more only on inserts); expiry and eviction later walk each queued position once. It runs
compiled (``ttl/simloop.c`` through ``ttl.simloop``, built by ``make native``: tens of
nanoseconds a visit, so P partitions cost what one process does) and, where the library is
not built, as ``_Cache`` here in Python: the reference of the same semantics, which
``tests/ttl/test_simloop.py`` checks the C loop against on random traces.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from operator import length_hint

import numpy as np

from ttl import simloop
from ttl.policy import DEFAULT_EVICTION_ORDER, EvictionOrder, TrafficClasses, is_expired
from ttl.traces import Trace

ALL = "all"
NO_MISS = np.int64(
    np.iinfo(np.int64).max
)  # first-miss position of a request none of whose blocks missed
DEFAULT_RATE_WINDOW_S = 3600.0  # the busy hour: one user's bursts average out, the day's cycle not
_SCAN_CHUNK = 64  # block positions searched per C call in _find_live
_VISIT_CHUNK = 4096  # visits whose block ids become one Python list at a time
_WINDOW = 8192  # block ids per list that expiry and eviction read queue entries from
ProgressFn = Callable[[int], None]  # called with the number of block accesses simulated


@dataclass(frozen=True)
class SimConfig:
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    capacity_blocks: int | None = None  # None: unlimited
    eviction: EvictionOrder = DEFAULT_EVICTION_ORDER  # the store's default
    warmup_fraction: float = 0.0
    rate_window_s: float = DEFAULT_RATE_WINDOW_S  # bucket of the peak read and write rates

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {self.capacity_blocks}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup fraction must be in [0, 1), got {self.warmup_fraction}")
        if not self.rate_window_s > 0:
            raise ValueError(f"rate window must be > 0 seconds, got {self.rate_window_s}")


@dataclass
class ClassStats:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    tokens_saved: int = 0
    input_tokens: int = 0
    inserted_blocks: int = 0
    expired_blocks: int = 0
    evicted_blocks: int = 0
    peak_blocks: int = 0
    block_seconds: float = 0.0
    written_blocks: int = 0
    peak_hit_blocks_per_s: float = 0.0
    peak_written_blocks_per_s: float = 0.0

    @property
    def block_hit_ratio(self) -> float:
        """Hit blocks / block accesses (NaN when the class has no counted access)."""
        return self.hit_blocks / self.blocks if self.blocks else math.nan

    @property
    def token_hit_ratio(self) -> float:
        return self.tokens_saved / self.tokens if self.tokens else math.nan

    def add(self, other: ClassStats) -> None:
        """Sum ``other`` into this one (peaks too: callers fix ``all``'s peaks)."""
        for name in _CLASS_STATS_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_CLASS_STATS_FIELDS = tuple(f.name for f in fields(ClassStats))


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    by_class: dict[str, ClassStats]  # every class of the trace, and ALL
    window_s: float  # length of the counted window
    num_trace_blocks: int  # distinct blocks in the whole trace

    def mean_blocks(self, traffic_class: str = ALL) -> float:
        """Time-averaged resident blocks over the window (the peak if it has no length)."""
        stats = self.by_class[traffic_class]
        return stats.block_seconds / self.window_s if self.window_s > 0 else stats.peak_blocks


@dataclass(frozen=True)
class SimCounts:
    """What one pass over a trace, or over one partition of its blocks, counted (sparse).

    Requests are indexed in the whole trace. Per request with a miss in this pass:
    ``miss_requests``, the position in the whole request of its first missing block
    (``miss_positions``) and the blocks it inserted (``miss_inserted``); a request with no miss
    inserted nothing. Resident-count changes: ``evict_*`` (request, class, blocks evicted right
    after it) and ``expiry_*`` (relative instant, class, blocks whose life ended then). Per
    class ``deaths``: the expired and evicted counts and the footprint terms of deaths and of
    the window's start. ``CountsTotal`` adds passes up (module docstring).
    """

    miss_requests: np.ndarray  # int64
    miss_positions: np.ndarray  # int64
    miss_inserted: np.ndarray  # int64
    evict_requests: np.ndarray  # int64
    evict_classes: np.ndarray  # int64
    evict_counts: np.ndarray  # int64
    expiry_s: np.ndarray  # float64, from the whole trace's first request
    expiry_classes: np.ndarray  # int64
    expiry_counts: np.ndarray  # int64
    deaths: tuple[ClassStats, ...]
    num_blocks: int  # distinct blocks seen


class CountsTotal:
    """The passes over disjoint parts of one trace's blocks, added up per request.

    ``first_miss`` (``NO_MISS`` where no pass missed), ``new_counts`` and ``live_changes``
    (per class and request: resident blocks gained right after it, less those that died at or
    before it since the previous request) are dense over the trace's requests; ``deaths``
    sums the passes' per-class death terms. The driver of a partitioned run holds this, not
    the passes.
    """

    def __init__(self, requests: Trace) -> None:
        num, num_classes = requests.num_requests, len(requests.class_names)
        self.times = _relative_times(requests)
        self.request_classes = requests.class_ids.astype(np.int64)
        self.first_miss = np.full(num, NO_MISS, np.int64)
        self.new_counts = np.zeros(num, np.int64)
        self.live_changes = np.zeros((num_classes, num), np.int64)
        self.deaths = tuple(ClassStats() for _ in range(num_classes))
        self.num_blocks = 0

    def add(self, counts: SimCounts) -> CountsTotal:
        """Add one pass (a pass names each request at most once among its misses)."""
        at = counts.miss_requests
        self.first_miss[at] = np.minimum(self.first_miss[at], counts.miss_positions)
        self.new_counts[at] += counts.miss_inserted
        num = self.live_changes.shape[1]
        changes = self.live_changes.reshape(-1)  # [class * num + request]
        changes[self.request_classes[at] * num + at] += counts.miss_inserted  # at: distinct
        np.add.at(changes, counts.evict_classes * num + counts.evict_requests, -counts.evict_counts)
        expiry_at = np.searchsorted(self.times, counts.expiry_s, side="left")  # is_expired: >=
        np.add.at(changes, counts.expiry_classes * num + expiry_at, -counts.expiry_counts)
        for mine, theirs in zip(self.deaths, counts.deaths, strict=True):
            mine.add(theirs)
        self.num_blocks += counts.num_blocks
        return self

    def live_by_class(self) -> np.ndarray:
        """int64 [classes, requests]: resident blocks of each class right after each request."""
        return np.cumsum(self.live_changes, axis=1)

    @classmethod
    def of(cls, requests: Trace, passes: list[SimCounts]) -> CountsTotal:
        total = cls(requests)
        for counts in passes:
            total.add(counts)
        return total


def simulate(trace: Trace, config: SimConfig, progress: ProgressFn | None = None) -> SimResult:
    """Replay ``trace`` through ``config``'s TTLs and capacity (module docstring: semantics)."""
    counts = simulate_counts(trace, config, progress)
    return sim_result(trace, config, CountsTotal.of(trace, [counts]))


def simulate_counts(
    trace: Trace,
    config: SimConfig,
    progress: ProgressFn | None = None,
    compiled: bool | None = None,
) -> SimCounts:
    """One pass over ``trace`` (or one partition of it), before the per-class sums.

    ``compiled``: run the C loop (``ttl.simloop``; None: when it is built) or the Python pass,
    the reference of the same semantics."""
    use_native = simloop.NATIVE if compiled is None else compiled
    if use_native and len(trace.class_names) <= simloop.MAX_CLASSES:
        return _native_counts(trace, config, progress)
    cache = _Cache(trace, config)
    cache.run(progress)
    return cache.counts()


def _native_counts(trace: Trace, config: SimConfig, progress: ProgressFn | None) -> SimCounts:
    """``_Cache``'s pass in C over the same arrays, in chunks of visits for ``progress``."""
    lengths = np.diff(trace.block_offsets)
    visit_times, classes = _relative_times(trace), trace.class_ids
    starts = trace.block_offsets[:-1]
    if lengths.all():  # a partition's requests all have blocks in it: visits are its rows
        visits = np.arange(len(lengths))
    else:
        visits = np.flatnonzero(lengths)
        starts, lengths = starts[visits], lengths[visits]
        visit_times, classes = visit_times[visits], classes[visits]
    end_s = _relative_end_s(trace)
    window_start_s = config.warmup_fraction * end_s
    ttl_s = [config.classes.ttl_s(name) for name in trace.class_names]
    native = simloop.NativePass(
        visit_times, classes, starts, lengths, trace.block_ids, trace.num_blocks,
        ttl_s, config.capacity_blocks, config.eviction is EvictionOrder.LRU, window_start_s,
    )  # fmt: skip
    try:
        edge = int(np.searchsorted(visit_times, window_start_s, side="left"))
        done, chunk = 0, _VISIT_CHUNK * 16 if progress is not None else len(visits) or 1
        for begin, end in ((0, edge), (edge, len(visits))):
            if begin == edge:
                native.start_window()
            for first in range(begin, end, chunk):
                last = min(first + chunk, end)
                native.visit(first, last)
                if progress is not None:
                    done += int(lengths[first:last].sum())
                    progress(done)
        native.finish(end_s)
        out = native.results()
    finally:
        native.close()
    stats = [
        ClassStats(expired_blocks=int(x), evicted_blocks=int(y), block_seconds=float(s))
        for x, y, s in zip(out["expired"], out["evicted"], out["block_seconds"], strict=True)
    ]
    return _pass_counts(trace, visits, starts, out["misses"], out["evictions"],
                        out["expiries"], stats)  # fmt: skip


def sim_result(trace: Trace, config: SimConfig, total: CountsTotal) -> SimResult:
    """Sum ``total`` by class over the counted window. ``trace`` gives the requests (every
    request of the trace: the whole trace or ``ttl.partition``'s requests) and ``config`` the
    window."""
    times = total.times
    end_s = float(times[-1]) if len(times) else 0.0
    window_start_s = config.warmup_fraction * end_s
    first_counted = int(np.searchsorted(times, window_start_s, side="left"))
    live = total.live_by_class()
    per_request = _PerRequest(trace, total, live, first_counted, window_start_s, config)
    by_class: dict[str, ClassStats] = {}
    all_stats = ClassStats()
    for k, name in enumerate(trace.class_names):
        stats = replace(total.deaths[k])
        mine = per_request.classes == k
        per_request.fill(stats, mine)
        end_live = int(live[k, -1]) if len(times) else 0
        stats.block_seconds += end_live * end_s
        stats.block_seconds = max(0.0, stats.block_seconds)  # cancellation leaves -1e-9s
        window_live = int(live[k, first_counted]) if len(times) else 0
        stats.peak_blocks = max(window_live, per_request.max_class_live(mine))
        by_class[name] = stats
        all_stats.add(stats)
    all_stats.peak_blocks = per_request.max_live()
    all_stats.peak_hit_blocks_per_s, all_stats.peak_written_blocks_per_s = per_request.peak_rates(
        np.ones(len(per_request.classes), bool)
    )
    by_class[ALL] = all_stats
    window_s = max(end_s - window_start_s, 0.0)
    return SimResult(config, by_class, window_s, total.num_blocks)


def _relative_times(trace: Trace) -> np.ndarray:
    """Request times from the whole trace's first request (the simulator's clock: exact sums)."""
    if trace.whole_span_s is not None:
        return trace.time_s - trace.whole_span_s[0]
    return trace.time_s - trace.time_s[0] if trace.num_requests else trace.time_s


def _relative_end_s(trace: Trace) -> float:
    """The whole trace's last request time on the simulator's clock."""
    if trace.whole_span_s is not None:
        first_s, last_s = trace.whole_span_s
        return float(np.float64(last_s) - np.float64(first_s))
    return float(trace.time_s[-1] - trace.time_s[0]) if trace.num_requests else 0.0


class _Cache:
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
        self.visit_times = _relative_times(trace)[visits]
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
        self.end_s = _relative_end_s(trace)
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
            for chunk in range(begin, end, _VISIT_CHUNK):
                done = self.visit(chunk, min(chunk + _VISIT_CHUNK, end), done)
                if progress is not None:
                    progress(done)
        self.live -= self.expire(self.end_s)

    # --- the hot loop ---------------------------------------------------------------------

    def visit(self, begin: int, end: int, done: int) -> int:
        """Visits ``[begin, end)``; returns the block accesses done. The dense hot path of this
        module: per block access only list indexing and compares on locals; per visit a few
        more around the two loops."""
        first, last = int(self.starts[begin]), int(self.starts[end - 1] + self.lengths[end - 1])
        ids = self.trace.block_ids[first:last].tolist()
        classes = self.classes[begin:end]
        entries = (np.arange(begin, end) * self.num_classes + classes).tolist()
        ttl_s = np.array(self.ttl_s)[classes] if len(self.ttl_s) else classes
        expiries = (self.visit_times[begin:end] + ttl_s).tolist()
        block_class, block_entry, queues = self.block_class, self.block_entry, self.queues
        live_by_class, touch_foreign = self.live_by_class, self.touch_foreign
        miss_visit, miss_index = self.miss_visits.append, self.miss_indexes.append
        miss_inserted = self.miss_inserted.append
        capacity = self.config.capacity_blocks
        capacity = sys.maxsize if capacity is None else capacity
        live, next_expiry_s, position = self.live, self.next_expiry_s, 0
        for v, now, c, entry, expires_s, n in zip(
            range(begin, end), self.times[begin:end], classes.tolist(), entries, expiries,
            self.lengths[begin:end].tolist(), strict=True,
        ):  # fmt: skip
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
        return done + last - first

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
        return _pass_counts(
            self.trace, self.visit_rows, self.starts, misses,
            np.asarray(self.evictions, np.int64).reshape(-1, 3),
            np.asarray(self.expiries, np.float64).reshape(-1, 3), self.stats,
        )  # fmt: skip


def _pass_counts(
    trace: Trace,
    visit_rows: np.ndarray,
    starts: np.ndarray,
    misses: np.ndarray,
    evictions: np.ndarray,
    expiries: np.ndarray,
    stats: list[ClassStats],
) -> SimCounts:
    """A pass's records as ``SimCounts``: ``misses`` [n, 3] (visit, index of the first miss in
    the visit's blocks, blocks inserted), ``evictions`` [n, 3] (visit, class, blocks) and
    ``expiries`` [n, 3] (instant, class, blocks), with requests and positions in the whole
    trace."""

    def requests(visits: np.ndarray) -> np.ndarray:
        rows = visit_rows[visits]
        return (rows if trace.request_ids is None else trace.request_ids[rows]).astype(np.int64)

    misses = misses.reshape(-1, 3)
    miss_visits, at = misses[:, 0], misses[:, 1]
    if trace.block_positions is not None:  # a partition: positions in the whole request
        at = trace.block_positions[starts[miss_visits] + at].astype(np.int64)
    return SimCounts(
        miss_requests=requests(miss_visits),
        miss_positions=at,
        miss_inserted=misses[:, 2].copy(),
        evict_requests=requests(evictions[:, 0]),
        evict_classes=evictions[:, 1].copy(),
        evict_counts=evictions[:, 2].copy(),
        expiry_s=expiries[:, 0].copy(),
        expiry_classes=expiries[:, 1].astype(np.int64),
        expiry_counts=expiries[:, 2].astype(np.int64),
        deaths=tuple(stats),
        num_blocks=trace.num_blocks,
    )


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


class _PerRequest:
    """The per-request counts of the counted window as numpy arrays."""

    def __init__(
        self,
        trace: Trace,
        total: CountsTotal,
        live: np.ndarray,
        first_counted: int,
        window_start_s: float,
        config: SimConfig,
    ) -> None:
        counted = slice(first_counted, trace.num_requests)
        self.classes = trace.class_ids[counted]
        self.num_blocks = trace.request_blocks[counted]
        self.num_hit = np.minimum(total.first_miss[counted], self.num_blocks)
        self.num_new = total.new_counts[counted]
        self.input_tokens = trace.input_tokens[counted]
        self.hashed_tokens = trace.hashed_tokens[counted]
        times = total.times
        self.times = times[counted]
        requests = np.arange(first_counted, trace.num_requests)
        self.class_live = live[self.classes, requests] if len(requests) else requests
        self.live = live[:, counted].sum(axis=0)
        self.block_tokens = trace.block_tokens
        window_s = (times[-1] if len(times) else 0.0) - window_start_s
        self.num_full_buckets = int(window_s // config.rate_window_s)
        if self.num_full_buckets:  # rates over whole buckets; a partial last one is left out
            self.rate_window_s = config.rate_window_s
            self.buckets = ((self.times - window_start_s) // config.rate_window_s).astype(np.int64)
        else:  # the window is shorter than a bucket: its own mean rate
            self.num_full_buckets, self.rate_window_s = 1, max(window_s, 1e-9)
            self.buckets = np.zeros(len(self.times), np.int64)

    def fill(self, stats: ClassStats, mine: np.ndarray) -> None:
        """Add the hit and insert counts of the requests selected by ``mine``."""
        saved = np.minimum(self.num_hit[mine] * self.block_tokens, self.input_tokens[mine])
        stats.requests = int(np.count_nonzero(mine))
        stats.blocks = int(self.num_blocks[mine].sum())
        stats.hit_blocks = int(self.num_hit[mine].sum())
        stats.written_blocks = stats.blocks - stats.hit_blocks
        stats.tokens = int(self.hashed_tokens[mine].sum())
        stats.tokens_saved = int(saved.sum())
        stats.input_tokens = int(self.input_tokens[mine].sum())
        stats.inserted_blocks = int(self.num_new[mine].sum())
        stats.block_seconds -= float(np.dot(self.num_new[mine], self.times[mine]))
        stats.peak_hit_blocks_per_s, stats.peak_written_blocks_per_s = self.peak_rates(mine)

    def peak_rates(self, mine: np.ndarray) -> tuple[float, float]:
        """Hit and written blocks per second in the busiest rate window."""
        if not np.any(mine):
            return 0.0, 0.0
        buckets, full = self.buckets[mine], self.num_full_buckets
        hits = np.bincount(buckets, weights=self.num_hit[mine], minlength=full)[:full]
        written = np.bincount(
            buckets, weights=self.num_blocks[mine] - self.num_hit[mine], minlength=full
        )[:full]
        return float(hits.max()) / self.rate_window_s, float(written.max()) / self.rate_window_s

    def max_class_live(self, mine: np.ndarray) -> int:
        return int(self.class_live[mine].max(initial=0))

    def max_live(self) -> int:
        return int(self.live.max(initial=0))
