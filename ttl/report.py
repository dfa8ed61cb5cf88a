"""Simulation results out: JSON, Parquet, a readable table and plots (matplotlib, Agg).

Plots: ``hit_ratio_vs_ttl.png`` (one panel per traffic class, the class's TTL in days on a
log axis; no expiry sits at 365 days, labelled inf) when some class has several TTLs, and
``hit_ratio_vs_capacity.png`` (one panel per class and ``all``, TB of KV on a numeric axis;
no limit sits at the total footprint it reached) when there are several capacities. Solid lines
are the token-weighted hit ratio, dashed the block hit ratio; curves that coincide exactly
are drawn once with their labels merged. The y axis shows 0-100% unless the caller passes a
range (``--y-range``): a fixed axis never makes 0.2 points look large. Point labels are
placed where they overlap no other label, or left out (``place_labels``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.table import Table

from ttl.simulator import ALL
from ttl.units import format_duration

Record = dict[str, Any]
TTL_PLOT, CAPACITY_PLOT = "hit_ratio_vs_ttl.png", "hit_ratio_vs_capacity.png"
FULL_RANGE = (0.0, 100.0)  # hit ratio axes show all of 0-100% unless asked to zoom
DAY_S = 86_400.0


def write_json(document: dict[str, Any], path: str | Path) -> None:
    """Write ``document`` (with a ``results`` list) as indented JSON; NaN is never written."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def write_parquet(records: Sequence[Record], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(records)), path)


def records_table(records: Sequence[Record]) -> Table:
    """The results as a table, the columns most worth keeping first (a narrow terminal shows
    the leftmost ones)."""
    table = Table(title="hit rate and footprint per traffic class")
    for column in ("class", "TTL", "capacity", "policy", "block hit", "token hit"):
        table.add_column(column, justify="left" if column in ("class", "policy") else "right")
    for column in ("tokens saved", "bytes x days", "peak blocks", "mean blocks", "requests"):
        table.add_column(column, justify="right")
    single_class = len({r["traffic_class"] for r in records}) == 2  # one class and ALL
    for r in records:
        if single_class and r["traffic_class"] == ALL:
            continue  # the same numbers as the class row
        table.add_row(
            r["traffic_class"],
            r["ttl_label"] if r["traffic_class"] == ALL else ttl_text(r),
            r["capacity_label"],
            r["policy"],
            _percent(r["block_hit_ratio"]),
            _percent(r["token_hit_ratio"]),
            f"{r['tokens_saved']:,}",
            _si_bytes(r["byte_days"]) + "-days",
            f"{r['peak_blocks']:,}",
            f"{r['mean_blocks']:,.0f}",
            f"{r['requests']:,}",
        )
    return table


def write_plots(
    records: Sequence[Record], plot_dir: str | Path, y_range: tuple[float, float] = FULL_RANGE
) -> list[Path]:
    """Draw the plots the records call for into ``plot_dir``; return the files written."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    classes = [c for c in dict.fromkeys(r["traffic_class"] for r in records) if c != ALL]
    if any(len({_ttl_key(r) for r in records if r["traffic_class"] == c}) > 1 for c in classes):
        axis = XAxis("TTL (log scale)", _ttl_days, ttl_text, log=True, ticks=_ttl_tick)
        plot_panels(records, classes, axis, _ttl_series, plot_dir / TTL_PLOT, y_range)
        written.append(plot_dir / TTL_PLOT)
    if len({r["capacity_label"] for r in records}) > 1:
        total_peak_tb = {
            (r["ttl_label"], r["policy"]): r["peak_bytes"] / 1e12
            for r in records
            if r["traffic_class"] == ALL
        }

        def capacity_tb(record: Record) -> float:
            """TB of KV the capacity allows; no limit: all classes' peak footprint (the
            capacity that never evicts), the same x in every panel."""
            if record["capacity_blocks"] is not None:
                return record["capacity_bytes"] / 1e12
            key = (record["ttl_label"], record["policy"])
            return total_peak_tb.get(key, record["peak_bytes"] / 1e12)

        axis = XAxis("capacity (TB of KV; no limit: at the total peak footprint)", capacity_tb,
                     _capacity_text, log=None)  # fmt: skip
        plot_panels(
            records, [*classes, ALL], axis, _capacity_series, plot_dir / CAPACITY_PLOT, y_range
        )
        written.append(plot_dir / CAPACITY_PLOT)
    return written


@dataclass(frozen=True)
class XAxis:
    """A numeric x axis: where a record sits on it, its point label, and the scale (``log``
    None: log when the values span more than 20x)."""

    title: str
    value: Callable[[Record], float]
    text: Callable[[Record], str]
    log: bool | None
    ticks: Callable[[float], str] | None = None  # ticks at the data's values, so labelled


def plot_panels(
    records: Sequence[Record],
    panels: Sequence[str],
    axis: XAxis,
    series_key: Callable[[Record], dict[str, str]],
    path: Path,
    y_range: tuple[float, float],
) -> None:
    """One panel per traffic class in ``panels``, saved as a PNG at ``path``."""
    fig = panel_figure(records, panels, axis, series_key, y_range)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def panel_figure(
    records: Sequence[Record],
    panels: Sequence[str],
    axis: XAxis,
    series_key: Callable[[Record], dict[str, str]],
    y_range: tuple[float, float],
) -> Any:
    """The figure ``plot_panels`` saves: hit ratio vs ``axis`` per class, labels placed."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    labels: dict[Any, list[PointLabel]] = {}
    for ax, panel in zip(axes[0], panels, strict=True):
        rows = [r for r in records if r["traffic_class"] == panel]
        labels[ax] = _draw_panel(ax, rows, axis, series_key, y_range)
        ax.set_title(f"{panel}: hit ratio")
        ax.set_xlabel(axis.title)
    axes[0][0].set_ylabel("hit ratio (%)  solid: token-weighted, dashed: blocks")
    fig.tight_layout()
    place_labels(fig, labels)
    return fig


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_panel(
    ax: Any,
    rows: Sequence[Record],
    axis: XAxis,
    series_key: Callable[[Record], dict[str, str]],
    y_range: tuple[float, float],
) -> list[PointLabel]:
    """Draw one panel's curves; return the point labels it asks for."""
    labels: list[PointLabel] = []
    curves: dict[tuple, dict[float, Record]] = {}
    for r in rows:
        curves.setdefault(tuple(series_key(r).items()), {})[axis.value(r)] = r
    merged: dict[tuple, list[dict[str, str]]] = {}  # identical curves are drawn once
    first_of: dict[tuple, list[Record]] = {}
    for parts, points in curves.items():
        ordered = [points[x] for x in sorted(points)]
        signature = tuple(
            (axis.value(r), r["token_hit_ratio"], r["block_hit_ratio"]) for r in ordered
        )
        merged.setdefault(signature, []).append(dict(parts))
        first_of.setdefault(signature, ordered)
    varying = _varying_parts([parts for group in merged.values() for parts in group])
    for signature, group in merged.items():
        x = [p[0] for p in signature]
        token = [_to_percent(p[1]) for p in signature]
        (line,) = ax.plot(x, token, marker="o", label=_group_label(group, varying))
        ax.plot(x, [_to_percent(p[2]) for p in signature], "--", color=line.get_color())
        for r, xi, yi in zip(first_of[signature], x, token, strict=True):
            labels.append(PointLabel(xi, yi, f"{axis.text(r)}: {yi:.2f}%", line.get_color()))
    if len(merged) > 1:
        ax.legend(fontsize="small", loc="lower right")
    elif varying:
        note = f"the same for {_group_label(next(iter(merged.values())), varying)}"
        ax.text(0.02, 0.02, note, transform=ax.transAxes, fontsize="small")
    set_numeric_x(ax, [axis.value(r) for r in rows], axis.log, axis.ticks)
    ax.set_ylim(*y_range)
    ax.grid(alpha=0.3)
    return labels


def set_numeric_x(
    ax: Any,
    values: Sequence[float],
    log: bool | None,
    ticks: Callable[[float], str] | None = None,
) -> None:
    """A numeric x axis over ``values``: log when asked (or, for None, when they span >20x);
    with ``ticks``, ticks sit at the values themselves, labelled by it."""
    finite = [v for v in values if math.isfinite(v) and v > 0]
    if log is None:
        log = bool(finite) and max(finite) > 20 * min(finite)
    if log and finite:
        ax.set_xscale("log")
        ax.set_xlim(min(finite) / 1.6, max(finite) * 1.6)
    else:
        ax.set_xlim(left=0, right=max(finite, default=1.0) * 1.12)
    if ticks is not None and finite:
        at = sorted(set(finite))
        ax.set_xticks(at, [ticks(v) for v in at])
        ax.minorticks_off()


@dataclass(frozen=True)
class PointLabel:
    x: float
    y: float
    text: str
    color: Any


def place_labels(fig: Any, labels: dict[Any, list[PointLabel]]) -> int:
    """Place each axes' point labels without overlapping another label or leaving the axes:
    each tries a few offsets around its point, nearest first, and is left out when none fits
    (the value is still in the JSON and the table). Returns the number placed."""
    renderer = fig.canvas.get_renderer()
    placed = 0
    for ax, wanted in labels.items():
        frame = ax.get_window_extent(renderer)
        taken = [_marker_box(ax, point) for point in wanted]  # labels never cover a point
        for point in wanted:
            for dx, dy in _LABEL_OFFSETS:
                label = ax.annotate(point.text, (point.x, point.y), textcoords="offset points",
                                    xytext=(dx, dy), fontsize="x-small", color=point.color,
                                    ha="center")  # fmt: skip
                box = label.get_window_extent(renderer)
                inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
                if inside and not any(box.overlaps(other) for other in taken):
                    taken.append(box)
                    placed += 1
                    break
                label.remove()
    return placed


def _marker_box(ax: Any, point: PointLabel, radius_px: float = 4.0) -> Any:
    from matplotlib.transforms import Bbox

    x, y = ax.transData.transform((point.x, point.y))
    return Bbox.from_extents(x - radius_px, y - radius_px, x + radius_px, y + radius_px)


_LABEL_OFFSETS = ((0, 6), (0, -13), (22, -3), (-22, -3), (0, 16), (0, -23), (30, 8), (-30, 8))


def _varying_parts(all_parts: list[dict[str, str]]) -> list[str]:
    """Names of the series parts that take more than one value in a panel."""
    names = dict.fromkeys(name for parts in all_parts for name in parts)
    return [n for n in names if len({parts.get(n) for parts in all_parts}) > 1]


def _group_label(group: list[dict[str, str]], varying: list[str]) -> str:
    """``chat=1d/3d policy=lru``: each varying part with the values its curves share."""
    return " ".join(
        f"{name}={'/'.join(dict.fromkeys(parts[name] for parts in group))}" for name in varying
    )


def _ttl_key(record: Record) -> float:
    return math.inf if record["ttl_s"] is None else record["ttl_s"]


def _ttl_days(record: Record) -> float:
    """The TTL in days; no expiry sits at twice the longest TTL of the grid (see the label)."""
    days = _ttl_key(record) / DAY_S
    return days if math.isfinite(days) else _NO_EXPIRY_DAYS


_NO_EXPIRY_DAYS = 365.0  # where "inf" sits on a TTL axis (its label says inf)


def _ttl_tick(days: float) -> str:
    return "inf" if days == _NO_EXPIRY_DAYS else format_duration(days * DAY_S)


def ttl_text(record: Record) -> str:
    return format_duration(_ttl_key(record))


def _ttl_series(record: Record) -> dict[str, str]:
    """What distinguishes TTL curves of one class: capacity, policy, the other classes' TTLs."""
    others = {
        name: format_duration(math.inf if ttl_s is None else ttl_s)
        for name, ttl_s in record["ttl_by_class"].items()
        if name != record["traffic_class"]
    }
    return {"capacity": record["capacity_label"], "policy": record["policy"], **others}


def _capacity_series(record: Record) -> dict[str, str]:
    ttls = {
        name: format_duration(math.inf if ttl_s is None else ttl_s)
        for name, ttl_s in record["ttl_by_class"].items()
    }
    return {"policy": record["policy"], **ttls}


def _capacity_text(record: Record) -> str:
    return "no limit" if record["capacity_blocks"] is None else record["capacity_label"]


def _to_percent(ratio: float | None) -> float:
    return math.nan if ratio is None else 100.0 * ratio


def _si_bytes(num_bytes: float) -> str:
    """``1.5e12`` -> ``"1.50 TB"`` (powers of 1000)."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100.0 * ratio:.2f}%"
