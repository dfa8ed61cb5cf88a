"""What the simulator takes and gives: ``SimConfig``, the per-class ``ClassStats`` and
``SimResult``, and ``SimCounts``, one pass's sparse counts (``ttl.simulator`` has the
semantics), with the helpers both passes (C and Python) build them with."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from ttl.policy import DEFAULT_EVICTION_ORDER, EvictionOrder, TrafficClasses
from ttl.traces import Trace

ALL = "all"
NO_MISS = np.int64(
    np.iinfo(np.int64).max
)  # first-miss position of a request none of whose blocks missed
DEFAULT_RATE_WINDOW_S = 3600.0  # the busy hour: one user's bursts average out, the day's cycle not
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


def relative_times(trace: Trace) -> np.ndarray:
    """Request times from the whole trace's first request (the simulator's clock: exact sums)."""
    if trace.whole_span_s is not None:
        return trace.time_s - trace.whole_span_s[0]
    return trace.time_s - trace.time_s[0] if trace.num_requests else trace.time_s


def relative_end_s(trace: Trace) -> float:
    """The whole trace's last request time on the simulator's clock."""
    if trace.whole_span_s is not None:
        first_s, last_s = trace.whole_span_s
        return float(np.float64(last_s) - np.float64(first_s))
    return float(trace.time_s[-1] - trace.time_s[0]) if trace.num_requests else 0.0


def pass_counts(
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
