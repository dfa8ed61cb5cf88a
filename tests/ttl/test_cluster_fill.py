"""ttl/cluster_fill.py: the fill model of issue 38 and the planner's usable fraction."""

from __future__ import annotations

import pytest

from bench.capacity_fill_bench import measure
from ttl.cluster_fill import fill_hit_ratio, usable_fraction
from ttl.plan import TierConfig


def test_a_fill_within_capacity_keeps_every_block() -> None:
    members = [[0, 1], [1, 2], [2, 0]]
    assert fill_hit_ratio([10, 10, 10], members, [0, 1, 2] * 4) == 1.0


def test_one_small_node_evicts_whole_blocks_for_its_groups() -> None:
    members = [[0, 1], [1, 2], [2, 0]]
    blocks = [0, 1, 2] * 20  # 40 shards per node
    small = fill_hit_ratio([100, 100, 10], members, blocks)
    # Node 2 holds the 40 blocks of groups 1 and 2 in 10 shards: at most 10 of them stay, and
    # group 0's 20 blocks are untouched.
    assert small <= 30 / 60, "a small node's evictions must take the whole block away"
    assert small >= 20 / 60, "blocks of groups without the small node were evicted"
    assert fill_hit_ratio([100, 100, 100], members, blocks) == 1.0


def test_usable_fraction_is_one_when_shares_follow_bytes() -> None:
    assert usable_fraction({"a": 2.0, "b": 1.0}, {"a": 2 / 3, "b": 1 / 3}) == pytest.approx(1.0)
    assert usable_fraction({"a": 2.0, "b": 1.0}, {"a": 0.5, "b": 0.5}) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="usable fraction"):
        TierConfig(usable_fraction=0.0)


def test_weighted_placement_keeps_the_hit_ratio_of_equal_nodes() -> None:
    """Issue 38's target: 24 nodes, 4 with half the space, a fill of 3x the small nodes'
    share: within 5 points of equal nodes with the same total; capacity-blind falls short."""
    rows = {row["cluster"]: row for row in measure(24, 4, 600, seed=3)["rows"]}
    for name in (
        "small nodes, weighted groups",
        "small nodes, rebalanced map",
        "small nodes, rebalanced, groups equal",
        "small nodes, cluster reweight (budget)",
    ):
        assert abs(rows[name]["points_vs_equal"]) <= 5, f"{name}: {rows[name]}"
    assert rows["small nodes, capacity-blind"]["points_vs_equal"] < -5
