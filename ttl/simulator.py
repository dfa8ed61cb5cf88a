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

Partitions. A pass over part of the block space (``Trace.block_positions`` set: one placement
group's blocks, every request kept) yields ``SimCounts`` that combine exactly: residency never
depends on hits (every block of a request is touched or inserted either way), so each
partition evolves on its own; a request's prefix hit is the earliest first-miss position over
the partitions, and every other count adds up. ``ttl.partition`` builds the partitions.

The core is pure: no clock, no I/O. Speed comes from one dense hot loop in ``_Cache.run``:
dense int block ids in flat lists, and per class a queue of *request* indices in time order
(the class's TTL is fixed, so time order is expiry order and LRU order) that expiry and
eviction consume lazily; a block's live entry is the request that touched it last. Per
access the loop does one list read and one list write (more only on inserts); expiry and
eviction later walk each queued position once, skipping stale ones in C.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np

from ttl.policy import DEFAULT_EVICTION_ORDER, EvictionOrder, TrafficClasses, is_expired
from ttl.traces import Trace

ALL = "all"
NO_MISS = np.int64(
    np.iinfo(np.int64).max
)  # first-miss position of a request none of whose blocks missed
DEFAULT_RATE_WINDOW_S = 3600.0  # the busy hour: one user's bursts average out, the day's cycle not
_SCAN_CHUNK = 64  # block positions searched per C call in _find_live
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
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


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
    """What one pass over a trace, or over one partition of its blocks, counted.

    Per request (``[num_requests]``, int64): ``first_miss``, the position in the request of its
    first missing block (``NO_MISS`` if none missed); ``new_counts``, blocks inserted;
    ``class_live_after`` and ``live_after``, resident blocks of the request's class and of all
    classes right after it. Per class: ``window_live`` (resident right after the first counted
    request), ``end_live`` (resident at the end) and ``deaths`` (expired and evicted blocks,
    and the footprint terms of deaths and of the window's start). ``combine`` merges the
    counts of disjoint partitions exactly (module docstring).
    """

    first_miss: np.ndarray
    new_counts: np.ndarray
    class_live_after: np.ndarray
    live_after: np.ndarray
    window_live: np.ndarray
    end_live: np.ndarray
    deaths: tuple[ClassStats, ...]
    num_blocks: int  # distinct blocks seen

    def combine(self, other: SimCounts) -> SimCounts:
        """The counts of this partition and ``other`` (disjoint blocks, the same requests)."""
        deaths = tuple(replace(mine) for mine in self.deaths)
        for mine, theirs in zip(deaths, other.deaths, strict=True):
            mine.add(theirs)
        return SimCounts(
            np.minimum(self.first_miss, other.first_miss),
            self.new_counts + other.new_counts,
            self.class_live_after + other.class_live_after,
            self.live_after + other.live_after,
            self.window_live + other.window_live,
            self.end_live + other.end_live,
            deaths,
            self.num_blocks + other.num_blocks,
        )


def simulate(trace: Trace, config: SimConfig, progress: ProgressFn | None = None) -> SimResult:
    """Replay ``trace`` through ``config``'s TTLs and capacity (module docstring: semantics)."""
    return sim_result(trace, config, simulate_counts(trace, config, progress))


def simulate_counts(
    trace: Trace, config: SimConfig, progress: ProgressFn | None = None
) -> SimCounts:
    """One pass over ``trace`` (or one partition of it), before the per-class sums."""
    cache = _Cache(trace, config)
    cache.run(progress)
    return cache.counts()


def sim_result(trace: Trace, config: SimConfig, counts: SimCounts) -> SimResult:
    """Sum ``counts`` by class over the counted window. ``trace`` gives the requests (any
    partition of it will do: they all keep every request) and ``config`` the window."""
    times = _relative_times(trace)
    window_start_s = config.warmup_fraction * (float(times[-1]) if len(times) else 0.0)
    end_s = float(times[-1]) if len(times) else 0.0
    first_counted = int(np.searchsorted(times, window_start_s, side="left"))
    per_request = _PerRequest(trace, counts, times, first_counted, window_start_s, config)
    by_class: dict[str, ClassStats] = {}
    total = ClassStats()
    for k, name in enumerate(trace.class_names):
        stats = replace(counts.deaths[k])
        mine = per_request.classes == k
        per_request.fill(stats, mine)
        stats.block_seconds += int(counts.end_live[k]) * end_s
        stats.block_seconds = max(0.0, stats.block_seconds)  # cancellation leaves -1e-9s
        stats.peak_blocks = max(int(counts.window_live[k]), per_request.max_class_live(mine))
        by_class[name] = stats
        total.add(stats)
    total.peak_blocks = per_request.max_live()
    total.peak_hit_blocks_per_s, total.peak_written_blocks_per_s = per_request.peak_rates(
        np.ones(len(per_request.classes), bool)
    )
    by_class[ALL] = total
    window_s = max(end_s - window_start_s, 0.0)
    return SimResult(config, by_class, window_s, counts.num_blocks)


def _relative_times(trace: Trace) -> np.ndarray:
    """Request times from the first request (the simulator's clock: exact sums)."""
    return trace.time_s - trace.time_s[0] if trace.num_requests else trace.time_s


class _Cache:
    """Simulation state.

    Per block: its class (-1 = not resident) and ``block_entry = r * num_classes + k``, the
    queue entry (request ``r`` in class ``k``'s queue) that holds its last touch. Per class: a
    queue of request indices in time order, consumed lazily by expiry and eviction from
    ``heads``/``cursors`` (first entry, and first block in it, not yet consumed); an entry
    stands for the blocks whose ``block_entry`` still names it. Per request: hits, inserts and
    resident counts, summed by class in ``result``.
    """

    def __init__(self, trace: Trace, config: SimConfig) -> None:
        self.trace, self.config = trace, config
        self.times: list[float] = _relative_times(trace).tolist()
        self.ttl_s = [config.classes.ttl_s(name) for name in trace.class_names]
        self.num_classes = num_classes = len(trace.class_names)
        self.block_class = [-1] * trace.num_blocks
        self.block_entry = [-1] * trace.num_blocks
        self.queues: list[list[int]] = [[] for _ in range(num_classes)]
        self.heads = [0] * num_classes
        self.cursors = [0] * num_classes
        self.front_blocks: list[list[int] | None] = [None] * num_classes
        self.live_by_class = [0] * num_classes
        self.hit_counts = [0] * trace.num_requests
        self.new_counts = [0] * trace.num_requests
        self.class_live_after = [0] * trace.num_requests  # resident blocks of its class
        self.live_after = [0] * trace.num_requests  # resident blocks of every class
        self.window_live = [0] * num_classes  # per class, right after the first counted request
        self.stats = [ClassStats() for _ in range(num_classes)]  # deaths; the rest in result()
        self.window_start_s = config.warmup_fraction * (self.times[-1] if self.times else 0.0)
        self.first_counted = bisect.bisect_left(self.times, self.window_start_s)
        self.counting = False
        self.next_expiry_s = math.inf

    # --- the hot loop ---------------------------------------------------------------------

    def run(self, progress: ProgressFn | None) -> None:
        """One pass over the trace. The dense hot path of this module: per block access only
        list indexing and compares on locals; per-request work sits around the two loops."""
        ids, offsets = self.trace.block_ids, self.trace.block_offsets.tolist()
        times, req_class, ttl_s = self.times, self.trace.class_ids.tolist(), self.ttl_s
        block_class, block_entry, queues = self.block_class, self.block_entry, self.queues
        live_by_class, num_classes = self.live_by_class, self.num_classes
        hit_counts, new_counts = self.hit_counts, self.new_counts
        class_live_after, live_after = self.class_live_after, self.live_after
        capacity = self.config.capacity_blocks
        capacity = sys.maxsize if capacity is None else capacity
        evict, touch_foreign = self.evict, self.touch_foreign
        live, window_edge = 0, self.first_counted
        for r in range(len(times)):
            now, c = times[r], req_class[r]
            if r == window_edge:  # the first counted request, then the one after it
                window_edge = self.on_window_edge(r)
            if is_expired(self.next_expiry_s, now):
                live -= self.expire(now)
            queues[c].append(r)
            if now + ttl_s[c] < self.next_expiry_s:
                self.next_expiry_s = now + ttl_s[c]
            entry = r * num_classes + c
            blocks = ids[offsets[r] : offsets[r + 1]].tolist()
            num_hit = 0
            for b in blocks:  # the prefix hit: leading resident blocks, touched
                k = block_class[b]
                if k == c:
                    block_entry[b] = entry
                elif k < 0:
                    break
                else:
                    touch_foreign(b, k, r, now)
                num_hit += 1
            num_new = 0
            for b in blocks[num_hit:]:  # the rest: insert missing blocks, touch resident ones
                k = block_class[b]
                if k == c:
                    block_entry[b] = entry
                elif k < 0:
                    block_class[b] = c
                    block_entry[b] = entry
                    num_new += 1
                else:
                    touch_foreign(b, k, r, now)
            live_by_class[c] += num_new
            live += num_new
            if live > capacity:
                evict(live - capacity, now)
                live = capacity
            hit_counts[r], new_counts[r] = num_hit, num_new
            class_live_after[r], live_after[r] = live_by_class[c], live
            if progress is not None and not r & 4095:
                progress(offsets[r])
        if window_edge == len(times):
            self.on_window_edge(window_edge)
        if progress is not None:
            progress(len(ids))

    # --- per request -----------------------------------------------------------------------

    def on_window_edge(self, r: int) -> int:
        """Start counting at the first counted request; note each class's resident blocks
        right after it (their first peak candidate). Returns the next request to call at."""
        if r == self.first_counted:
            self.counting = True
            for stats, live in zip(self.stats, self.live_by_class, strict=True):
                stats.block_seconds = -live * self.window_start_s
            return r + 1
        self.window_live = list(self.live_by_class)
        return -1

    def touch_foreign(self, b: int, k: int, r: int, now: float) -> None:
        """Request ``r`` touched block ``b`` of class ``k`` (not its own): queue it under ``k``."""
        self.block_entry[b] = r * self.num_classes + k
        queue = self.queues[k]
        if queue[-1] != r:  # a resident block of class k means queue k is not empty
            queue.append(r)
            self.next_expiry_s = min(self.next_expiry_s, now + self.ttl_s[k])

    # --- expiry and eviction ---------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop every block whose expiry instant is <= now; return how many."""
        num_expired = 0
        next_expiry_s = math.inf
        for k, ttl_s in enumerate(self.ttl_s):
            queue = self.queues[k]
            while self.heads[k] < len(queue):
                expires_at_s = self.times[queue[self.heads[k]]] + ttl_s
                if not is_expired(expires_at_s, now):
                    next_expiry_s = min(next_expiry_s, expires_at_s)
                    break
                num_expired += self.drop_front(k, expires_at_s)
        self.next_expiry_s = next_expiry_s
        return num_expired

    def drop_front(self, k: int, expires_at_s: float) -> int:
        """Expire the live blocks of queue ``k``'s front entry, then pop it."""
        entry = self.queues[k][self.heads[k]] * self.num_classes + k
        block_class, block_entry = self.block_class, self.block_entry
        blocks, position, num = self.front(k), self.cursors[k], 0
        while position < len(blocks):
            b = blocks[position]
            if block_entry[b] == entry:
                block_class[b] = block_entry[b] = -1
                num += 1
                position += 1
            else:
                position = _find_live(blocks, position + 1, entry, block_entry)
        self.pop_front(k)
        self.record_deaths(k, num, expires_at_s, evicted=False)
        return num

    def evict(self, num: int, now: float) -> None:
        """Evict ``num`` resident blocks, smallest priority first (module docstring, rule 4)."""
        block_class, block_entry = self.block_class, self.block_entry
        while num:
            k = self.lowest_priority_class()  # leaves queue k's cursor on a live block
            entry = self.queues[k][self.heads[k]] * self.num_classes + k
            blocks, position, wanted = self.front(k), self.cursors[k], num
            while num and position < len(blocks):  # one entry: one priority
                b = blocks[position]
                if block_entry[b] == entry:
                    block_class[b] = block_entry[b] = -1
                    num -= 1
                    position += 1
                else:
                    position = _find_live(blocks, position + 1, entry, block_entry)
            self.cursors[k] = position
            self.record_deaths(k, wanted - num, now, evicted=True)

    def lowest_priority_class(self) -> int:
        """The class whose next live block has the smallest eviction priority."""
        best_k, best_priority = -1, math.inf
        for k, ttl_s in enumerate(self.ttl_s):
            if not self.seek_live(k):
                continue
            last_s = self.times[self.queues[k][self.heads[k]]]
            priority = self.config.eviction.priority(last_s, last_s + ttl_s)
            if best_k < 0 or priority < best_priority:
                best_k, best_priority = k, priority
        assert best_k >= 0, "evict() with no resident block: the live count is off"
        return best_k

    def seek_live(self, k: int) -> bool:
        """Move queue ``k``'s head and cursor to its first live block; False if it has none."""
        queue = self.queues[k]
        while self.heads[k] < len(queue):
            entry, blocks = queue[self.heads[k]] * self.num_classes + k, self.front(k)
            position = _find_live(blocks, self.cursors[k], entry, self.block_entry)
            if position < len(blocks):
                self.cursors[k] = position
                return True
            self.pop_front(k)
        return False

    def front(self, k: int) -> list[int]:
        """Block ids of queue ``k``'s front request (cached until it is popped)."""
        blocks = self.front_blocks[k]
        if blocks is None:
            r = self.queues[k][self.heads[k]]
            offsets = self.trace.block_offsets
            blocks = self.trace.block_ids[offsets[r] : offsets[r + 1]].tolist()
            self.front_blocks[k] = blocks
        return blocks

    def pop_front(self, k: int) -> None:
        self.heads[k] += 1
        self.cursors[k] = 0
        self.front_blocks[k] = None
        if self.heads[k] > 4096 and self.heads[k] * 2 > len(self.queues[k]):
            del self.queues[k][: self.heads[k]]  # keep queue memory proportional to live data
            self.heads[k] = 0

    def record_deaths(self, k: int, num: int, death_s: float, evicted: bool) -> None:
        self.live_by_class[k] -= num
        if not self.counting or not num:
            return
        stats = self.stats[k]
        stats.block_seconds += num * max(death_s, self.window_start_s)
        if evicted:
            stats.evicted_blocks += num
        elif death_s >= self.window_start_s:  # not those that died before the window
            stats.expired_blocks += num

    # --- result ----------------------------------------------------------------------------

    def counts(self) -> SimCounts:
        """The pass's counts; first-miss positions from hit counts (numpy, once)."""
        num_hit = np.asarray(self.hit_counts, np.int64)
        offsets = self.trace.block_offsets
        lengths = np.diff(offsets)
        positions = self.trace.block_positions
        if positions is None:  # the whole request: the first miss is at the hit count
            first_miss = np.where(num_hit < lengths, num_hit, NO_MISS)
        else:  # a partition: the position (in the whole request) of its first missing block
            missed = num_hit < lengths
            at = np.minimum(offsets[:-1] + num_hit, max(len(positions) - 1, 0))
            at_position = positions[at].astype(np.int64) if len(positions) else 0
            first_miss = np.where(missed, at_position, NO_MISS)
        return SimCounts(
            first_miss=first_miss.astype(np.int64),
            new_counts=np.asarray(self.new_counts, np.int64),
            class_live_after=np.asarray(self.class_live_after, np.int64),
            live_after=np.asarray(self.live_after, np.int64),
            window_live=np.asarray(self.window_live, np.int64),
            end_live=np.asarray(self.live_by_class, np.int64),
            deaths=tuple(self.stats),
            num_blocks=self.trace.num_blocks,
        )


def _find_live(blocks: list[int], start: int, entry: int, block_entry: list[int]) -> int:
    """The first position >= ``start`` whose block's live entry is ``entry``, else len(blocks).

    Stale positions (blocks touched again later) are most of what expiry and eviction walk
    over, so the search runs in C: ``map`` fetches a chunk of entries, ``list.index`` finds.
    """
    if start < len(blocks) and block_entry[blocks[start]] == entry:
        return start  # the common case when a run of live blocks is being consumed
    get = block_entry.__getitem__
    while start < len(blocks):
        chunk = list(map(get, blocks[start : start + _SCAN_CHUNK]))
        if entry in chunk:
            return start + chunk.index(entry)
        start += len(chunk)
    return len(blocks)


class _PerRequest:
    """The per-request counts of the counted window as numpy arrays."""

    def __init__(
        self,
        trace: Trace,
        counts: SimCounts,
        times: np.ndarray,
        first_counted: int,
        window_start_s: float,
        config: SimConfig,
    ) -> None:
        counted = slice(first_counted, trace.num_requests)
        self.classes = trace.class_ids[counted]
        self.num_blocks = trace.request_blocks[counted]
        self.num_hit = np.minimum(counts.first_miss[counted], self.num_blocks)
        self.num_new = counts.new_counts[counted]
        self.input_tokens = trace.input_tokens[counted]
        self.hashed_tokens = trace.hashed_tokens[counted]
        self.times = times[counted]
        self.class_live = counts.class_live_after[counted]
        self.live = counts.live_after[counted]
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
