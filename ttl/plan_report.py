"""Plans out: a readable table and the hit ratio vs raw SSD TB plot (``kvstore plan``).

The plot has one panel per traffic class and ``all``: raw TB on a numeric axis (log when the
settings span more than 20x), token hit ratio on y (0-100% unless a range is given). Where a
class has several capacities, a curve joins the capacities of one TTL setting; otherwise a
curve joins the TTLs of one capacity. Point labels name the setting and never overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from ttl.report import FULL_RANGE, XAxis, plot_panels, ttl_text
from ttl.simulator import ALL

Record = dict
PLAN_PLOT = "hit_ratio_vs_raw_tb.png"


def plan_table(planned: Sequence[Record]) -> Table:
    """One row per class (and ``all``) and setting: sizes, nodes, bandwidth, cost, savings."""
    scale = planned[0]["scale"] if planned else 1.0
    table = Table(
        title=f"capacity plan ({planned[0]['bytes_per_token']:g} B/token, traffic x{scale:.4g})"
        if planned
        else "capacity plan",
        caption="raw = (logical + EC + headers + index + expiry slack) / watermark; "
        "GB/s at the storage nodes, peak (mean); marginal: per point of token hit ratio",
    )
    columns = (
        *("class", "TTL", "capacity", "token hit", "logical TB", "+EC", "+hdr", "+index"),
        *("+slack", "+wm", "raw TB", "nodes", "read GB/s", "write GB/s", "$/month"),
        *("tokens saved/day", "marginal"),
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("class", "TTL") else "right")
    for r in planned:
        table.add_row(
            r["traffic_class"],
            r["ttl_label"] if r["traffic_class"] == ALL else ttl_text(r),
            r["capacity_label"],
            _percent(r["token_hit_ratio"]),
            *(_tb(r[key]) for key in ("logical_tb", "erasure_tb", "headers_tb", "index_tb")),
            *(_tb(r[key]) for key in ("expiry_slack_tb", "watermark_tb", "raw_tb")),
            f"{r['nodes']:,} ({r['nodes_bound_by']})",
            f"{_tb(r['read_gb_per_s'])} ({_tb(r['mean_read_gb_per_s'])})",
            f"{_tb(r['write_gb_per_s'])} ({_tb(r['mean_write_gb_per_s'])})",
            "-" if r["usd_per_month"] is None else f"{r['usd_per_month']:,.0f}",
            _count(r["prefill_tokens_saved_per_day"]),
            _marginal(r),
        )
    return table


def write_plan_plots(
    planned: Sequence[Record], plot_dir: str | Path, y_range: tuple[float, float] = FULL_RANGE
) -> list[Path]:
    """Hit ratio vs raw SSD TB, one panel per class and ``all``; returns the file written."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    classes = [c for c in dict.fromkeys(r["traffic_class"] for r in planned) if c != ALL]
    many_capacities = len({r["capacity_label"] for r in planned}) > 1

    def series(record: Record) -> dict[str, str]:
        ttl = record["ttl_label"] if record["traffic_class"] == ALL else ttl_text(record)
        varied = {"TTL": ttl} if many_capacities else {"capacity": record["capacity_label"]}
        return {**varied, "policy": record["policy"]}

    def point_text(record: Record) -> str:
        if many_capacities:
            return record["capacity_label"]
        return record["ttl_label"] if record["traffic_class"] == ALL else ttl_text(record)

    axis = XAxis("raw SSD TB", lambda r: r["raw_tb"], point_text, log=None)
    path = plot_dir / PLAN_PLOT
    plot_panels(planned, [*classes, ALL], axis, series, path, y_range)
    return [path]


def _tb(value: float) -> str:
    """TB (or GB/s): whole numbers from 100 up, else three significant digits."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _count(value: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100.0 * ratio:.2f}%"


def _marginal(record: Record) -> str:
    if record["dominated"]:
        return "dominated"
    if record["marginal_usd_per_point"] is not None:
        return f"${record['marginal_usd_per_point']:,.0f}/pt"
    per_point = record["marginal_raw_tb_per_point"]
    return "-" if per_point is None or not math.isfinite(per_point) else f"{per_point:.3g} TB/pt"
