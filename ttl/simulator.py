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
not built, as ``ttl.sim_python.PythonPass``: the reference of the same semantics, which
``tests/ttl/test_simloop.py`` checks the C loop against on random traces.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ttl import simloop
from ttl.policy import EvictionOrder
from ttl.sim_counts import (
    ALL,
    DEFAULT_RATE_WINDOW_S,
    NO_MISS,
    ClassStats,
    ProgressFn,
    SimConfig,
    SimCounts,
    SimResult,
    pass_counts,
    relative_end_s,
    relative_times,
)
from ttl.sim_python import VISIT_CHUNK, PythonPass
from ttl.traces import Trace

__all__ = [
    "ALL",
    "DEFAULT_RATE_WINDOW_S",
    "NO_MISS",
    "ClassStats",
    "CountsTotal",
    "ProgressFn",
    "SimConfig",
    "SimCounts",
    "SimResult",
    "sim_result",
    "simulate",
    "simulate_counts",
]


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
        self.times = relative_times(requests)
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
    python_pass = PythonPass(trace, config)
    python_pass.run(progress)
    return python_pass.counts()


def _native_counts(trace: Trace, config: SimConfig, progress: ProgressFn | None) -> SimCounts:
    """``PythonPass``'s pass in C over the same arrays, in chunks of visits for ``progress``."""
    lengths = np.diff(trace.block_offsets)
    visit_times, classes = relative_times(trace), trace.class_ids
    starts = trace.block_offsets[:-1]
    if lengths.all():  # a partition's requests all have blocks in it: visits are its rows
        visits = np.arange(len(lengths))
    else:
        visits = np.flatnonzero(lengths)
        starts, lengths = starts[visits], lengths[visits]
        visit_times, classes = visit_times[visits], classes[visits]
    end_s = relative_end_s(trace)
    window_start_s = config.warmup_fraction * end_s
    ttl_s = [config.classes.ttl_s(name) for name in trace.class_names]
    native = simloop.NativePass(
        visit_times, classes, starts, lengths, trace.block_ids, trace.num_blocks,
        ttl_s, config.capacity_blocks, config.eviction is EvictionOrder.LRU, window_start_s,
    )  # fmt: skip
    try:
        edge = int(np.searchsorted(visit_times, window_start_s, side="left"))
        done, chunk = 0, VISIT_CHUNK * 16 if progress is not None else len(visits) or 1
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
    return pass_counts(trace, visits, starts, out["misses"], out["evictions"],
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
