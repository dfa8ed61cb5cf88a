"""Plots: numeric axes, a fixed hit-ratio range, point labels that never overlap."""

from __future__ import annotations

import itertools

from ttl.report import FULL_RANGE, XAxis, panel_figure, pyplot, write_plots

DAY = 86_400.0


def _record(ttl_s: float | None, capacity: int | None, hit: float, cls: str = "chat") -> dict:
    return {
        "traffic_class": cls, "ttl_s": ttl_s, "ttl_by_class": {cls: ttl_s},
        "ttl_label": f"{cls}={ttl_s}", "capacity_blocks": capacity,
        "capacity_label": "inf" if capacity is None else str(capacity),
        "capacity_bytes": None if capacity is None else capacity * 1e9, "peak_bytes": 5e12,
        "policy": "lru", "token_hit_ratio": hit, "block_hit_ratio": hit,
    }  # fmt: skip


def _boxes(fig):
    renderer = fig.canvas.get_renderer()
    return [
        (ax, [t.get_window_extent(renderer) for t in ax.texts if "%" in t.get_text()])
        for ax in fig.axes
    ]


def test_crowded_labels_never_overlap_and_stay_inside() -> None:
    # Eight TTLs a few hours apart with hit ratios 0.01 points apart: every label wants the
    # same spot.
    records = [_record((1 + i / 8) * DAY, None, 0.9 + i * 1e-4) for i in range(8)]
    records += [_record((1 + i / 8) * DAY, 1000, 0.5 + i * 1e-4) for i in range(8)]
    axis = XAxis("TTL", lambda r: r["ttl_s"] / DAY, lambda r: f"{r['ttl_s'] / DAY:.2f}d", True)
    fig = panel_figure(records, ["chat"], axis, lambda r: {"cap": r["capacity_label"]},
                       FULL_RANGE)  # fmt: skip
    for ax, boxes in _boxes(fig):
        assert boxes, "some labels must be placed"
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), "two point labels overlap: place_labels let them collide"
        frame = ax.get_window_extent(fig.canvas.get_renderer())
        assert all(frame.contains(b.x0, b.y0) and frame.contains(b.x1, b.y1) for b in boxes)
        assert ax.get_ylim() == FULL_RANGE, "the hit-ratio axis must not zoom by itself"
        assert ax.get_xscale() == "log", "TTLs go on a numeric (log) axis, not categories"
    pyplot().close(fig)


def test_sim_plots_use_numeric_axes_and_the_given_range(tmp_path) -> None:
    records = [_record(t * DAY, c, 0.5 + 0.1 * i + (c or 0) / 1e5)
               for i, t in enumerate((1, 3, 7)) for c in (1000, None)]  # fmt: skip
    written = write_plots(records, tmp_path / "plots", y_range=(40.0, 80.0))
    assert sorted(p.name for p in written) == ["hit_ratio_vs_capacity.png", "hit_ratio_vs_ttl.png"]
    assert all(p.stat().st_size > 0 for p in written)
    capacity_axis = XAxis("TB", lambda r: (r["capacity_bytes"] or r["peak_bytes"]) / 1e12,
                          lambda r: r["capacity_label"], None)  # fmt: skip
    fig = panel_figure(records, ["chat"], capacity_axis, lambda r: {"ttl": str(r["ttl_s"])},
                       (40.0, 80.0))  # fmt: skip
    (ax,) = fig.axes
    assert ax.get_ylim() == (40.0, 80.0)
    low, high = ax.get_xlim()
    assert low == 0.0 and high > 5.0, "capacity in TB on a numeric axis from 0 to the peak"
    pyplot().close(fig)
