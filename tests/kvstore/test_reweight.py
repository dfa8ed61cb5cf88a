"""Moving an equal map to capacity weights (kvstore/reweight.py): the default fit moves no
more shards than the change in weights requires and leaves each node near its weight; the
exact fit reaches the weights; bad requests raise and change nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import InvalidArgument
from kvstore.map_changes import changed_slots, drain, shards_moved
from kvstore.placement import make_groups
from kvstore.placement_weights import map_group_weights, node_shares, node_weights
from kvstore.reweight import (
    expected_moves,
    ideal_moves,
    move_report,
    reweight,
    share_gain,
    targets,
)

GiB = 1 << 30
WIDTH = 12


def _map(num_nodes: int) -> ClusterConfig:
    nodes = tuple(
        NodeConfig(f"n{i:02d}", f"127.0.0.1:{20000 + i}", 0, f"host{i:02d}", f"/tmp/n{i:02d}",
                   max_bytes=GiB)
        for i in range(num_nodes)
    )  # fmt: skip
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH)
    return ClusterConfig(epoch=3, nodes=nodes, groups=tuple(groups))


def _half(small: list[int]) -> dict[str, int]:
    return {f"n{i:02d}": GiB // 2 for i in small}


def _keys(num_keys: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_keys, 16), dtype=np.uint8)


def _settled(cfg: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(cfg, moving_from=())


def _worst(cfg: ClusterConfig) -> float:
    target = targets(cfg.groups, node_weights(cfg.nodes))
    share = node_shares(cfg.groups, map_group_weights(cfg))
    return max(share[n] / target[n] for n in target)


LAYOUTS = [(24, [20, 21, 22, 23]), (24, [3, 9, 15, 21]), (16, [5, 6]), (13, [4])]


@pytest.mark.parametrize(("num_nodes", "small"), LAYOUTS)
def test_the_default_fit_moves_no_more_than_the_weights_require(
    num_nodes: int, small: list[int]
) -> None:
    """Expected moves (exact for this fit) within the ideal; on a sample within sampling
    noise. Shares: no node more than one slot over its weight's share of the slots (whole
    slots' rounding, which the budget only ever corrects), and never worse than the groups
    kept equal where those stay within the ideal too."""
    old = _map(num_nodes)
    new = reweight(old, _half(small))
    exact = reweight(old, _half(small), "exact")
    weights = node_weights(new.nodes)
    ideal = ideal_moves(old.groups, exact.groups, exact.group_weights)
    scaled = [g for g, w in enumerate(new.group_weights) if w < max(new.group_weights)]
    ratio = new.group_weights[scaled[0]] / max(new.group_weights) if scaled else 1.0
    assert expected_moves(old.groups, new.groups, scaled, ratio) <= ideal * (1 + 1e-6)
    keys = _keys(60_000)
    count = shards_moved(old, new, keys, share_gain(old, exact, keys))
    assert count.ratio_to_ideal <= 1.01, f"moved {count.ratio_to_ideal:.4f}x the ideal"
    fewest_slots = min(targets(new.groups, weights).values()) * len(new.groups)
    assert _worst(new) <= 1 + 1 / fewest_slots, f"a node is over by more than a slot: {_worst(new)}"
    slots = reweight(old, _half(small), "slots")
    if len(changed_slots(old.groups, slots.groups)) <= ideal * len(old.groups):
        assert _worst(new) <= _worst(slots) + 1e-9, "the budget fit made the worst node worse"


def test_expected_moves_is_what_keys_do() -> None:
    """The analytic count the budget is spent by agrees with a key sample."""
    old = _map(24)
    new = reweight(old, _half([20, 21, 22, 23]), "slots")
    scaled, ratio = [0, 5, 9], 0.8
    weights = tuple(round(ratio * 1000) if g in scaled else 1000 for g in range(24))
    weighted = dataclasses.replace(new, group_weights=weights)
    keys = _keys(200_000)
    measured = shards_moved(old, weighted, keys, 1).moved_shards / len(keys)
    expected = expected_moves(old.groups, new.groups, scaled, ratio)
    assert abs(measured - expected) < 0.01 * expected, (measured, expected)


def test_exact_fit_reaches_the_weights_and_the_map_is_a_move() -> None:
    old = _map(24)
    new = reweight(old, _half([20, 21, 22, 23]), "exact")
    assert _worst(new) < 1.001
    assert new.epoch == old.epoch + 1 and new.moving_from == old.groups, "not a move: no repair"
    assert new.node("n20").max_bytes == GiB // 2 and new.node("n00").max_bytes == GiB
    for group in new.groups:
        assert len({new.node(n).failure_domain for n in group}) == WIDTH, group
    # A later change keeps the recorded weights: it moves only its slots.
    assert drain(_settled(new), "n01").group_weights == new.group_weights


def test_report_counts_what_the_bench_counts() -> None:
    old = _map(24)
    report = move_report(old, reweight(old, _half([20, 21, 22, 23])), 20_000, seed=1)
    assert report["slots_moved"] == 20 and report["slots"] == 288
    assert report["ratio_to_ideal"] <= 1.01 and 0 < report["keys_regrouped"] < 0.01 * 20_000
    assert len(report["nodes"]) == 24 and report["worst_share_over_weight"] < 1.06


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: reweight(c, {"n99": GiB}), "no node n99"),
        (lambda c: reweight(c, {"n01": 0}), "positive size"),
        (lambda c: reweight(c, {}), "same byte limit"),
        (lambda c: reweight(c, _half([1]), "nope"), "fit must be one of"),
        (lambda c: reweight(dataclasses.replace(c, moving_from=c.groups), _half([1])), "moving"),
        (lambda c: reweight(_settled(reweight(c, _half([1, 2]), "exact")), {}), "already placed"),
    ],
)
def test_bad_requests_raise_with_advice(
    change: Callable[[ClusterConfig], object], says: str
) -> None:
    with pytest.raises(InvalidArgument, match=says):
        change(_map(16))
