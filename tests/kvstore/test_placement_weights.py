"""Capacity-aware placement (issue 38): a node with half the space holds about half the shards,
and moving a map to weights moves no more shards than the change in shares requires."""

from __future__ import annotations

import numpy as np

from kvstore.config import ClusterConfig, NodeConfig
from kvstore.placement import Placement, group_of_key, groups_of_keys, make_groups
from kvstore.placement_weights import (
    group_weights,
    node_weights,
    rebalance_slots,
    share_report,
)

GiB = 1 << 30
WIDTH = 12


def _nodes(num_nodes: int, num_small: int) -> list[NodeConfig]:
    """Nodes each its own failure domain; the last ``num_small`` have half the space."""
    return [
        NodeConfig(
            f"n{i:02d}",
            f"127.0.0.1:{20000 + i}",
            0,
            f"host{i:02d}",
            f"/tmp/n{i:02d}",
            max_bytes=GiB // 2 if i >= num_nodes - num_small else GiB,
        )
        for i in range(num_nodes)
    ]


def _keys(num_keys: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (num_keys, 16), dtype=np.uint8)


def _shard_counts(groups: list[tuple[str, ...]], key_groups: np.ndarray) -> dict[str, int]:
    per_group = np.bincount(key_groups, minlength=len(groups))
    counts: dict[str, int] = {}
    for group, num_keys in zip(groups, per_group, strict=True):
        for node_id in group:
            counts[node_id] = counts.get(node_id, 0) + int(num_keys)
    return counts


def test_equal_limits_keep_plain_rendezvous() -> None:
    nodes = _nodes(12, 0)
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH)
    config = ClusterConfig(epoch=1, nodes=tuple(nodes), groups=tuple(groups))
    placement = Placement(config)
    assert placement.weights is None, "equal byte limits must not weight any group"
    keys = [bytes(k) for k in _keys(200)]
    assert [placement.group_index(k) for k in keys] == [group_of_key(k, len(groups)) for k in keys]


def test_a_node_with_half_the_space_holds_about_half_the_shards() -> None:
    nodes = _nodes(24, 4)
    weights = node_weights(nodes)
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH, None, weights)
    config = ClusterConfig(epoch=1, nodes=tuple(nodes), groups=tuple(groups))
    placement = Placement(config)
    keys = _keys(40_000)
    key_groups = groups_of_keys(keys, len(groups), placement.weights)
    python = [placement.group_index(bytes(k)) for k in keys[:2000]]
    assert python == key_groups[:2000].tolist(), "numpy and Python weighted placement disagree"
    counts = _shard_counts(groups, key_groups)
    total = sum(counts.values())
    for node_id, (share, weight) in share_report(nodes, groups, placement.weights).items():
        held = counts[node_id] / total
        assert abs(held - weight) < 0.05 * weight, (
            f"{node_id} holds {held:.4f} of the shards against a weight of {weight:.4f}"
        )
        assert abs(share - weight) < 0.01 * weight, f"{node_id}: fitted share {share:.4f}"


def test_rebalancing_an_existing_map_moves_only_the_shards_the_weights_require() -> None:
    nodes = _nodes(24, 4)
    weights = node_weights(nodes)
    domains = {n.id: n.failure_domain for n in nodes}
    before = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH)
    after = rebalance_slots(before, domains, weights)
    for group in after:
        assert len({domains[n] for n in group}) == WIDTH, f"a domain twice in {group}"
    keys = _keys(40_000)
    key_groups = groups_of_keys(keys, len(before))  # slots move, keys keep their group
    old = np.array([[int(n[1:]) for n in g] for g in before])[key_groups]
    new = np.array([[int(n[1:]) for n in g] for g in after])[key_groups]
    moved = int((old != new).sum())
    gained = np.bincount(new.ravel(), minlength=24) - np.bincount(old.ravel(), minlength=24)
    assert moved == int(np.maximum(gained, 0).sum()), "a shard moved that no share change needs"
    small = np.bincount(new.ravel(), minlength=24)[20:] / new.size
    assert np.all(small < 0.6 / 22), f"small nodes still hold {small} of the shards"
    assert group_weights(after, dict.fromkeys(domains, 1.0)) is None
