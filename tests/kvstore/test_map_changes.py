"""Map changes (kvstore/map_changes.py): few shards moved, domains kept apart, safe order."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from erasure.config import CodecConfig
from kvstore.config import (
    ClusterConfig,
    MembershipConfig,
    NodeConfig,
    cluster_from_toml,
    cluster_to_toml,
)
from kvstore.errors import InvalidArgument
from kvstore.map_changes import (
    changed_slots,
    drain,
    finish_move,
    held_shards,
    ideal_join_shards,
    join,
    mark_out,
    remove,
    shards_moved,
    slot_counts,
)
from kvstore.node.map_keeper import NEVER_SEEN_GRACE_S, DownClock
from kvstore.placement import groups_of_keys, make_groups
from kvstore.placement_weights import map_group_weights, node_weights

WIDTH = 12


def node(i: int, domain: str | None = None) -> NodeConfig:
    return NodeConfig(
        id=f"n{i:02d}",
        address=f"127.0.0.1:{40000 + i}",
        metrics_port=0,
        failure_domain=domain or f"host{i:02d}",
        data_dir=f"/tmp/n{i:02d}",
    )


def cluster(num_nodes: int = 12, domains: int | None = None) -> ClusterConfig:
    nodes = tuple(
        node(i, None if domains is None else f"host{i % domains}") for i in range(num_nodes)
    )
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH)
    return ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=CodecConfig())


@pytest.fixture(scope="module")
def keys() -> np.ndarray:
    return np.random.default_rng(15).integers(0, 256, (20_000, 16), dtype=np.uint8)


def test_map_round_trips_through_toml_with_states_move_and_membership() -> None:
    cfg = dataclasses.replace(
        drain(cluster(13), "n03"),
        membership=MembershipConfig(etcd="127.0.0.1:2379", down_out_s=60.0),
    )
    again = cluster_from_toml(cluster_to_toml(cfg))
    assert again == cfg, "the map must survive (de)serialisation exactly (etcd stores the text)"
    assert again.node("n03").state == "draining" and again.moving_from == cluster(13).groups


def test_join_moves_the_newcomers_fair_share_and_keeps_groups_domain_disjoint(
    keys: np.ndarray,
) -> None:
    before = cluster(12)
    after = join(before, node(12))
    count = shards_moved(before, after, keys, ideal_join_shards(len(keys) * WIDTH, 13))
    assert 0.9 <= count.ratio_to_ideal <= 1.1, f"join moved {count} shards, far from the ideal"
    assert after.epoch == 2 and after.moving_from == before.groups
    loads = slot_counts(after.groups)
    assert max(loads.values()) - min(loads.values()) <= 1, (
        f"join left the slots unbalanced: {loads}"
    )
    for group in after.groups:
        domains = [after.node(n).failure_domain for n in group]
        assert len(set(domains)) == WIDTH, f"join put two shards of a group in one domain: {group}"
    # Regenerating the groups from scratch would move far more: the point of slot moves.
    regenerated = dataclasses.replace(
        after,
        groups=tuple(make_groups([(n.id, n.failure_domain) for n in after.nodes], WIDTH)),
        moving_from=(),
    )
    naive = shards_moved(before, regenerated, keys, count.ideal_shards)
    assert naive.moved_shards > 3 * count.moved_shards, (naive, count)


def test_drain_moves_only_the_nodes_own_shards_then_remove_needs_the_move_finished(
    keys: np.ndarray,
) -> None:
    before = finish_move(join(cluster(12), node(12)))
    drained = drain(before, "n04")
    count = shards_moved(before, drained, keys, held_shards(before, "n04", keys))
    assert count.moved_shards == count.ideal_shards, f"drain moved other shards too: {count}"
    assert all("n04" not in g for g in drained.groups)
    assert all(old == "n04" for _, _, old, _ in changed_slots(before.groups, drained.groups))
    with pytest.raises(InvalidArgument, match="drain it first"):
        remove(drained, "n04")
    with pytest.raises(InvalidArgument, match="still moving"):
        join(drained, node(20))
    done = finish_move(drained)
    assert done.node("n04").state == "left" and not done.moving_from
    gone = remove(done, "n04")
    assert "n04" not in {n.id for n in gone.nodes} and gone.epoch == drained.epoch + 2


def test_mark_out_during_a_move_keeps_the_first_fallback_and_spreads_domains() -> None:
    before = cluster(16, domains=8)
    draining = drain(before, "n01")
    out = mark_out(draining, "n02")
    assert out.moving_from == before.groups, "reads must fall back to the map before both moves"
    for group in out.groups:
        per_domain = Counter(out.node(n).failure_domain for n in group)
        assert max(per_domain.values()) <= 2, f"a group got 3 shards in one of 8 domains: {group}"
    assert {"n01", "n02"}.isdisjoint({n for g in out.groups for n in g})


def test_too_few_nodes_left_is_refused_with_advice() -> None:
    with pytest.raises(InvalidArgument, match="join a node first"):
        drain(cluster(12), "n00")
    with pytest.raises(InvalidArgument, match="already in the map"):
        join(cluster(12), node(3))


def test_down_clock_marks_out_after_down_out_s_and_gives_new_nodes_grace() -> None:
    cfg = dataclasses.replace(cluster(13), membership=MembershipConfig(down_out_s=600.0))
    everyone = {n.id for n in cfg.nodes}
    down = DownClock()
    assert down.due(cfg, everyone, 0.0) == []
    assert down.due(cfg, everyone - {"n05"}, 10.0) == [], "down is not out before down_out_s"
    assert down.due(cfg, everyone - {"n05"}, 609.0) == []
    assert down.due(cfg, everyone - {"n05"}, 610.0) == ["n05"], "down_out_s passed: out"
    assert down.due(cfg, everyone, 611.0) == [] and down.due(cfg, everyone - {"n05"}, 612.0) == []
    # A node this keeper never saw live (still starting after a join) waits the grace too.
    joined = join(cfg, node(13))
    assert down.due(joined, everyone, 0.0) == []
    assert down.due(joined, everyone, 600.0 + NEVER_SEEN_GRACE_S - 1) == []
    assert down.due(joined, everyone, 601.0 + NEVER_SEEN_GRACE_S) == ["n13"]


def weighted_cluster(num_nodes: int = 24, num_small: int = 4) -> ClusterConfig:
    """A map whose last ``num_small`` nodes have half the byte limit: its groups weighted."""
    nodes = tuple(
        dataclasses.replace(node(i), max_bytes=(1 << 29) if i >= num_nodes - num_small else 1 << 30)
        for i in range(num_nodes)
    )
    weights = node_weights(nodes)
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH, None, weights)
    return ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=CodecConfig())


def test_changes_of_a_weighted_map_keep_every_key_in_its_group(keys: np.ndarray) -> None:
    """Refitting the weights to the new slots moved a fifth of the keys to other groups on a
    drain (5.4x the drained node's shards), where reads during the move do not look."""
    cfg = weighted_cluster()
    weights = map_group_weights(cfg)
    assert weights is not None, "a map with half nodes must weight its groups"
    before = groups_of_keys(keys, len(cfg.groups), weights)
    big = dataclasses.replace(node(24), max_bytes=1 << 30)
    changes = {
        "join": join(cfg, big),
        "drain": drain(cfg, "n01"),
        "drain a small node": drain(cfg, "n22"),
        "out": mark_out(cfg, "n02"),
    }
    for name, new in changes.items():
        after = groups_of_keys(keys, len(new.groups), map_group_weights(new))
        assert (after == before).all(), f"{name}: {(after != before).sum()} keys changed group"
        assert cluster_from_toml(cluster_to_toml(new)) == new, f"{name}: weights lost in TOML"
    for name, node_id in (("drain", "n01"), ("out", "n02")):
        moved = shards_moved(cfg, changes[name], keys, held_shards(cfg, node_id, keys))
        assert moved.moved_shards == moved.ideal_shards, f"{name}: {moved}"
    settled = finish_move(changes["drain"])
    assert map_group_weights(settled) == weights, "finishing the move changed the weights"
    assert map_group_weights(remove(settled, "n01")) == weights


def test_changes_of_an_equal_map_record_no_weights() -> None:
    cfg = cluster(13)
    for new in (drain(cfg, "n03"), join(cfg, node(13)), mark_out(cfg, "n04")):
        assert new.group_weights == () and map_group_weights(new) is None
        assert "weight" not in cluster_to_toml(new), "an equal map must keep its old TOML form"


def test_a_joining_node_with_another_limit_does_not_reweight_an_equal_map(
    keys: np.ndarray,
) -> None:
    cfg = weighted_cluster(num_small=0)  # every node 1 GiB: plain rendezvous
    assert map_group_weights(cfg) is None
    joined = join(cfg, dataclasses.replace(node(24), max_bytes=1 << 29))
    assert joined.group_weights == (1,) * len(cfg.groups), "equal weights must be recorded"
    assert map_group_weights(joined) is None, "recorded equal weights are plain rendezvous"
    moved = shards_moved(cfg, joined, keys, held_shards(joined, "n24", keys))
    assert moved.moved_shards == moved.ideal_shards, moved


def test_recorded_group_weights_are_checked() -> None:
    cfg = weighted_cluster()
    text = cluster_to_toml(dataclasses.replace(cfg, group_weights=(3,) * len(cfg.groups)))
    assert map_group_weights(cluster_from_toml(text)) is None
    with pytest.raises(ValueError, match="one integer >= 1 per group"):
        dataclasses.replace(cfg, group_weights=(1, 2))
    with pytest.raises(ValueError, match="every entry a weight, or none"):
        cluster_from_toml(text.replace("weight = 3\n", "", 1))
