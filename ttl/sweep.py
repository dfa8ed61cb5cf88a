"""Grids of TTL settings, capacities and eviction policies, run over one trace, as records.

``--ttl chat=1h,1d,7d --ttl agent=inf`` gives every combination of the listed per-class TTLs
(here three settings); classes of the trace not named keep the store's defaults (chat 7d,
agent 3d). ``--capacity 10%,25%,inf`` lists capacities: a share of the trace's distinct
blocks, a block count, bytes such as ``2TiB`` (needs the block size in bytes), or ``inf``.

Each grid point gives one record per traffic class of the trace and one for ``all``. A
class's ``ttl_s`` is its TTL (``None`` = no expiry); for ``all`` it is the TTL shared by every
class, or ``None`` when they differ: ``ttl_label`` and ``ttl_by_class`` always say exactly.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ttl.policy import DEFAULT_CLASS_TO_TTL_S, EvictionOrder, TrafficClasses
from ttl.simulator import (
    ALL,
    DEFAULT_RATE_WINDOW_S,
    ProgressFn,
    SimConfig,
    SimResult,
    simulate,
)
from ttl.traces import Trace
from ttl.units import DAY_S, format_duration, parse_duration_s, parse_size_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    label: str  # as the user wrote it: "10%", "5000", "2TiB", "inf"
    blocks: int | None  # None: unlimited


@dataclass(frozen=True)
class GridPoint:
    ttl_by_class: Mapping[str, float]
    capacity: Capacity
    eviction: EvictionOrder

    @property
    def ttl_label(self) -> str:
        return " ".join(f"{n}={format_duration(s)}" for n, s in self.ttl_by_class.items())


def parse_ttl_grid(specs: Sequence[str], class_names: Sequence[str]) -> list[dict[str, float]]:
    """Every combination of the per-class TTL lists in ``specs``, over the trace's classes."""
    class_to_values = {
        n: [DEFAULT_CLASS_TO_TTL_S[n]] for n in class_names if n in DEFAULT_CLASS_TO_TTL_S
    }
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip():
            raise ValueError(
                f"bad --ttl {spec!r}: expected CLASS=DURATION[,DURATION...], e.g. chat=7d or "
                "chat=1h,1d,7d (inf = no expiry)"
            )
        if name not in class_names:
            log.warning("--ttl %s: the trace has no requests of class %r", spec, name)
            continue
        class_to_values[name] = [parse_duration_s(v) for v in values.split(",")]
    missing = [n for n in class_names if n not in class_to_values]
    if missing:
        raise ValueError(
            f"the trace has traffic class(es) {missing} with no TTL: pass --ttl "
            f"{missing[0]}=3d (or map them with --class / --type-class)"
        )
    names = list(class_names)
    combos = itertools.product(*(class_to_values[n] for n in names))
    settings = [dict(zip(names, combo, strict=True)) for combo in combos]
    for setting in settings:
        TrafficClasses(setting)  # validates names and TTLs with advice
    return settings


def parse_capacities(spec: str, num_trace_blocks: int, block_bytes: int | None) -> list[Capacity]:
    """``"10%,25%,inf"`` -> capacities; see the module docstring for the forms."""
    return [parse_capacity(part, num_trace_blocks, block_bytes) for part in spec.split(",")]


def parse_capacity(text: str, num_trace_blocks: int, block_bytes: int | None) -> Capacity:
    value = text.strip().lower()
    if value in ("inf", "none", "unlimited"):
        return Capacity(text.strip(), None)
    if value.endswith("%"):
        share = float(value[:-1]) / 100.0
        if share < 0.0:
            raise ValueError(f"capacity {text!r}: a share must be >= 0%")
        return Capacity(text.strip(), round(share * num_trace_blocks))
    if value.isdigit():
        return Capacity(text.strip(), int(value))
    return Capacity(text.strip(), _bytes_to_blocks(text, value, block_bytes))


def _bytes_to_blocks(text: str, value: str, block_bytes: int | None) -> int:
    try:
        if not value[-1:].isalpha():
            raise ValueError("a byte count needs a unit")
        num_bytes = parse_size_bytes(value)
    except ValueError:
        raise ValueError(
            f"bad capacity {text!r}: use a share ('10%'), a block count ('50000'), bytes "
            "('2TiB', '500GB') or 'inf'"
        ) from None
    if block_bytes is None:
        raise ValueError(f"capacity {text!r} is in bytes: pass --bytes-per-token too")
    return num_bytes // block_bytes


def grid_points(
    ttl_settings: Sequence[Mapping[str, float]],
    capacities: Sequence[Capacity],
    evictions: Sequence[EvictionOrder],
) -> list[GridPoint]:
    return [
        GridPoint(ttl, capacity, eviction)
        for ttl, capacity, eviction in itertools.product(ttl_settings, capacities, evictions)
    ]


def run_grid(
    trace: Trace,
    points: Sequence[GridPoint],
    warmup_fraction: float = 0.0,
    progress: ProgressFn | None = None,
    rate_window_s: float = DEFAULT_RATE_WINDOW_S,
) -> list[SimResult]:
    """Simulate every grid point; ``progress`` sees block accesses over the whole grid."""
    results = []
    for i, point in enumerate(points):
        config = point_config(point, warmup_fraction, rate_window_s)
        done = i * trace.num_accesses
        point_progress = None if progress is None else (lambda n, d=done: progress(d + n))
        results.append(simulate(trace, config, point_progress))
    return results


def point_config(
    point: GridPoint, warmup_fraction: float = 0.0, rate_window_s: float = DEFAULT_RATE_WINDOW_S
) -> SimConfig:
    """The simulator's configuration for one grid point."""
    return SimConfig(
        TrafficClasses(dict(point.ttl_by_class)),
        point.capacity.blocks,
        point.eviction,
        warmup_fraction,
        rate_window_s,
    )


def result_records(
    point: GridPoint, result: SimResult, block_tokens: int, bytes_per_token: float
) -> list[dict[str, Any]]:
    """One flat record per class and ``all`` (the JSON and Parquet rows)."""
    block_bytes = block_tokens * bytes_per_token
    ttls = list(point.ttl_by_class.values())
    common_ttl = ttls[0] if len(set(ttls)) == 1 else math.inf
    records = []
    for name, stats in result.by_class.items():
        ttl_s = common_ttl if name == ALL else point.ttl_by_class[name]
        mean_blocks = result.mean_blocks(name)
        capacity = point.capacity.blocks
        records.append(
            {
                "traffic_class": name,
                "ttl_s": None if math.isinf(ttl_s) else ttl_s,
                "ttl_label": point.ttl_label,
                "ttl_by_class": {n: _finite_or_none(s) for n, s in point.ttl_by_class.items()},
                "capacity_blocks": capacity,
                "capacity_label": point.capacity.label,
                "capacity_bytes": None if capacity is None else capacity * block_bytes,
                "policy": point.eviction.value,
                "warmup_fraction": result.config.warmup_fraction,
                "requests": stats.requests,
                "blocks": stats.blocks,
                "hit_blocks": stats.hit_blocks,
                "block_hit_ratio": _finite_or_none(stats.block_hit_ratio),
                "tokens": stats.tokens,
                "tokens_saved": stats.tokens_saved,
                "token_hit_ratio": _finite_or_none(stats.token_hit_ratio),
                "input_tokens": stats.input_tokens,
                "inserted_blocks": stats.inserted_blocks,
                "expired_blocks": stats.expired_blocks,
                "evicted_blocks": stats.evicted_blocks,
                "written_blocks": stats.written_blocks,
                "peak_hit_blocks_per_s": stats.peak_hit_blocks_per_s,
                "peak_written_blocks_per_s": stats.peak_written_blocks_per_s,
                "rate_window_s": result.config.rate_window_s,
                "peak_blocks": stats.peak_blocks,
                "mean_blocks": mean_blocks,
                "peak_bytes": stats.peak_blocks * block_bytes,
                "mean_bytes": mean_blocks * block_bytes,
                "byte_days": stats.block_seconds * block_bytes / DAY_S,
                "block_tokens": block_tokens,
                "bytes_per_token": bytes_per_token,
                "window_s": result.window_s,
                "trace_blocks": result.num_trace_blocks,
            }
        )
    return records


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
