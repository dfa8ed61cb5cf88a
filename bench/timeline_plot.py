"""Draw swap-in fetch timelines (``kvstore bench swapin --timeline-png``): one panel per
transport, one row per lane (the client's stages on top, then each node), bars per span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt

COLORS = {
    "fetch": "#dddddd",
    "swap-in": "#b0b0ff",
    "wait": "#f2e0b0",
    "tally": "#e07b39",
    "check": "#4c9f70",
    "stop": "#aa3355",
    "decode": "#2e6f9e",
    "request": "#e8e8e8",
    "queue": "#c9a0dc",
    "read": "#3b5b92",
    "land": "#e0b000",
}
CLIENT_ROWS = ["fetch", "swap-in", "wait", "tally", "check", "stop", "decode"]


def plot_timelines(records: list[Any], title: str, path: Path) -> None:
    """One panel per record (its ``timeline`` rows) into ``path``."""
    records = [r for r in records if r.timeline]
    figure, axes = plt.subplots(
        len(records), 1, figsize=(12, 1.5 + 0.32 * _num_rows(records)), squeeze=False
    )
    for ax, record in zip(axes[:, 0], records, strict=True):
        _panel(ax, record)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _num_rows(records: list[Any]) -> int:
    return max(len(_lanes(r.timeline)) for r in records) * len(records)


def _lanes(rows: list[dict[str, Any]]) -> list[str]:
    """Client rows (one per client stage) first, then the nodes in name order."""
    client = [f"client {w}" for w in CLIENT_ROWS if any(_lane(r) == f"client {w}" for r in rows)]
    nodes = sorted({r["lane"] for r in rows if r["lane"] != "client"})
    return client + nodes


def _lane(row: dict[str, Any]) -> str:
    return f"client {row['what']}" if row["lane"] == "client" else row["lane"]


def _panel(ax: Any, record: Any) -> None:
    rows = record.timeline
    lanes = _lanes(rows)
    y_of = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    seen: set[str] = set()
    for row in rows:
        what = row["what"]
        start, width = row["start_ms"], max(row["end_ms"] - row["start_ms"], 0.05)
        y = y_of[_lane(row)]
        # A node lane stacks request (full height), queue, read and land (thinner, inside).
        height = 0.8 if what in ("request",) or row["lane"] == "client" else 0.45
        ax.broken_barh(
            [(start, width)],
            (y - height / 2, height),
            facecolors=COLORS.get(what, "#888888"),
            edgecolor="black" if what in ("read", "check", "decode") else "none",
            linewidth=0.3,
            label=what if what not in seen else None,
        )
        seen.add(what)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)), fontsize=7)
    ax.set_xlabel("ms from the fetch's start", fontsize=8)
    ax.set_title(
        f"{record.transport}: {record.gb_per_s:.2f} GB/s into the pool, client "
        f"{record.client_cpu_s_per_gb:.2f} / nodes {record.nodes_cpu_s_per_gb:.2f} CPU-s per GB",
        fontsize=8,
    )
    ax.legend(fontsize=6, ncol=6, loc="upper right")
    ax.grid(axis="x", linewidth=0.3)
