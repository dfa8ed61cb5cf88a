"""Grids: TTL and capacity specs, grid points and result records."""

from __future__ import annotations

import math

import pytest

from ttl.policy import EvictionOrder
from ttl.sweep import (
    Capacity,
    GridPoint,
    format_duration,
    grid_points,
    parse_capacities,
    parse_capacity,
    parse_ttl_grid,
    result_records,
    run_grid,
)
from ttl.traces import trace_from_records

DAY = 86_400.0


def test_ttl_grid_is_the_product_over_the_trace_classes() -> None:
    grid = parse_ttl_grid(["chat=1h,1d", "agent=inf"], ["agent", "chat"])
    assert grid == [{"agent": math.inf, "chat": 3600.0}, {"agent": math.inf, "chat": DAY}]


def test_ttl_grid_defaults_and_unknown_classes() -> None:
    assert parse_ttl_grid([], ["chat"]) == [{"chat": 7 * DAY}], "store default: chat 7d"
    assert parse_ttl_grid(["agent=1d"], ["chat"]) == [{"chat": 7 * DAY}], "absent class ignored"
    with pytest.raises(ValueError, match="--ttl batch=3d"):
        parse_ttl_grid([], ["batch"])
    with pytest.raises(ValueError, match="CLASS=DURATION"):
        parse_ttl_grid(["chat"], ["chat"])
    with pytest.raises(ValueError, match="bad duration"):
        parse_ttl_grid(["chat=7 days"], ["chat"])


@pytest.mark.parametrize(
    ("text", "blocks"),
    [("inf", None), ("10%", 100), ("25.5%", 255), ("5000", 5000), ("2MiB", 2048), ("1GB", 976562)],
)
def test_capacity_forms(text: str, blocks: int | None) -> None:
    assert parse_capacity(text, num_trace_blocks=1000, block_bytes=1024).blocks == blocks


def test_capacity_errors() -> None:
    with pytest.raises(ValueError, match="--bytes-per-token"):
        parse_capacity("2TiB", 1000, None)
    with pytest.raises(ValueError, match="share"):
        parse_capacity("lots", 1000, 1024)
    assert [c.label for c in parse_capacities("10%, inf", 10, None)] == ["10%", "inf"]


def test_format_duration_round_trips_units() -> None:
    assert [format_duration(s) for s in (604800, 3 * DAY, 5400, 90, math.inf)] == [
        "1w", "3d", "90m", "90s", "inf",
    ]  # fmt: skip


def test_records_per_class_and_all_with_bytes() -> None:
    trace = trace_from_records(
        [(0.0, "chat", 8, 0, [1, 2]), (DAY, "agent", 8, 0, [1, 2]), (2 * DAY, "chat", 8, 0, [1])],
        block_tokens=4,
        chain=False,
    )
    points = grid_points(
        [{"agent": 3 * DAY, "chat": 7 * DAY}], [Capacity("inf", None)], [EvictionOrder.EXPIRY]
    )
    (result,) = run_grid(trace, points)
    records = result_records(points[0], result, block_tokens=4, bytes_per_token=10.0)
    by_class = {r["traffic_class"]: r for r in records}
    assert set(by_class) == {"agent", "chat", "all"}
    assert by_class["all"]["ttl_s"] is None, "classes differ: all has no single TTL"
    assert by_class["all"]["ttl_label"] == "agent=3d chat=1w"
    assert by_class["chat"]["ttl_s"] == 7 * DAY
    assert by_class["agent"]["block_hit_ratio"] == 1.0
    assert by_class["chat"]["block_hit_ratio"] == pytest.approx(1 / 3)
    # blocks 1 and 2 are chat blocks (inserted by chat), resident for the whole 2 days
    assert by_class["chat"]["byte_days"] == pytest.approx(2 * 2 * 40)
    assert by_class["all"]["peak_bytes"] == 2 * 40
    assert by_class["agent"]["mean_blocks"] == 0.0


def test_run_grid_progress_covers_all_points() -> None:
    trace = trace_from_records([(0.0, "chat", 4, 0, [1])], 4, chain=False)
    points = grid_points([{"chat": DAY}, {"chat": 2 * DAY}], [Capacity("inf", None)], list(
        EvictionOrder))  # fmt: skip
    seen: list[int] = []
    run_grid(trace, points, progress=seen.append)
    assert max(seen) == 4 * trace.num_accesses
    assert GridPoint({"chat": DAY}, Capacity("1", 1), EvictionOrder.LRU).ttl_label == "chat=1d"
