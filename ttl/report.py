"""Simulation results out: JSON, Parquet, a readable table and plots (matplotlib, Agg).

Plots: ``hit_ratio_vs_ttl.png`` (one panel per traffic class, the class's TTL on x) when some
class has several TTLs, and ``hit_ratio_vs_capacity.png`` (one panel per class and ``all``)
when there are several capacities. Solid lines are the token-weighted hit ratio, dashed the
block hit ratio; curves that coincide exactly are drawn once with their labels merged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.table import Table

from ttl.simulator import ALL
from ttl.units import format_duration

Record = dict[str, Any]
TTL_PLOT, CAPACITY_PLOT = "hit_ratio_vs_ttl.png", "hit_ratio_vs_capacity.png"
_MAX_ANNOTATED_CURVES = 4


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
            r["ttl_label"] if r["traffic_class"] == ALL else _ttl_text(r),
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


def write_plots(records: Sequence[Record], plot_dir: str | Path) -> list[Path]:
    """Draw the plots the records call for into ``plot_dir``; return the files written."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    classes = [c for c in dict.fromkeys(r["traffic_class"] for r in records) if c != ALL]
    if any(len({_ttl_key(r) for r in records if r["traffic_class"] == c}) > 1 for c in classes):
        _plot_panels(records, classes, _ttl_key, _ttl_text, _ttl_series, plot_dir / TTL_PLOT, "TTL")
        written.append(plot_dir / TTL_PLOT)
    if len({r["capacity_label"] for r in records}) > 1:
        _plot_panels(
            records,
            [*classes, ALL],
            _capacity_key,
            lambda r: r["capacity_label"],
            _capacity_series,
            plot_dir / CAPACITY_PLOT,
            "capacity",
        )
        written.append(plot_dir / CAPACITY_PLOT)
    return written


def _plot_panels(
    records: Sequence[Record],
    panels: Sequence[str],
    x_key: Callable[[Record], float],
    x_text: Callable[[Record], str],
    series_key: Callable[[Record], dict[str, str]],
    path: Path,
    x_title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        rows = [r for r in records if r["traffic_class"] == panel]
        _draw_panel(ax, rows, x_key, x_text, series_key)
        ax.set_title(f"{panel}: hit ratio vs {x_title}")
        ax.set_xlabel(f"{x_title} of {panel}" if x_title == "TTL" else x_title)
    axes[0][0].set_ylabel("hit ratio (%)  solid: token-weighted, dashed: blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_panel(
    ax: Any,
    rows: Sequence[Record],
    x_key: Callable[[Record], float],
    x_text: Callable[[Record], str],
    series_key: Callable[[Record], dict[str, str]],
) -> None:
    xs = sorted({x_key(r) for r in rows})
    position = {x: i for i, x in enumerate(xs)}
    curves: dict[tuple, dict[float, Record]] = {}
    for r in rows:
        curves.setdefault(tuple(series_key(r).items()), {})[x_key(r)] = r
    merged: dict[tuple, list[dict[str, str]]] = {}  # identical curves are drawn once
    for parts, points in curves.items():
        signature = tuple(
            (x, points[x]["token_hit_ratio"], points[x]["block_hit_ratio"]) for x in sorted(points)
        )
        merged.setdefault(signature, []).append(dict(parts))
    varying = _varying_parts([parts for group in merged.values() for parts in group])
    for signature, group in merged.items():
        x = [position[p[0]] for p in signature]
        token = [_to_percent(p[1]) for p in signature]
        (line,) = ax.plot(x, token, marker="o", label=_group_label(group, varying))
        ax.plot(x, [_to_percent(p[2]) for p in signature], "--", color=line.get_color())
        if len(merged) <= _MAX_ANNOTATED_CURVES:
            for xi, yi in zip(x, token, strict=True):
                ax.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(0, 6))
    if len(merged) > 1:
        ax.legend(fontsize="small")
    elif varying:
        note = f"the same for {_group_label(next(iter(merged.values())), varying)}"
        ax.text(0.02, 0.02, note, transform=ax.transAxes, fontsize="small")
    labels_by_x = {x_key(r): x_text(r) for r in rows}
    ax.set_xticks(range(len(xs)), [labels_by_x[x] for x in xs])
    ax.margins(y=0.12)
    ax.grid(alpha=0.3)


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


def _ttl_text(record: Record) -> str:
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


def _capacity_key(record: Record) -> float:
    blocks = record["capacity_blocks"]
    return math.inf if blocks is None else float(blocks)


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
