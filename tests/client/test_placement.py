"""Placement: rendezvous hashing of keys to groups, and group generation over failure domains."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import InvalidArgument
from kvstore.placement import Placement, check_key, group_of_key, make_groups

WIDTH = 12


def _keys(num_keys: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(num_keys)]


@pytest.mark.parametrize("num_groups", [1, 5, 12, 40])
def test_adding_a_group_moves_about_one_in_g_plus_one_keys_and_only_to_it(num_groups: int) -> None:
    keys = _keys(20_000)
    before = [group_of_key(k, num_groups) for k in keys]
    after = [group_of_key(k, num_groups + 1) for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == num_groups for _, a in moved), "a key moved between two old groups"
    expected = 1 / (num_groups + 1)
    assert abs(len(moved) / len(keys) - expected) < 0.25 * expected + 0.005, (
        f"moved {len(moved) / len(keys):.4f} of keys, expected ~{expected:.4f}: "
        "the hash is not rendezvous-stable"
    )


def test_keys_spread_evenly_over_groups() -> None:
    counts = Counter(group_of_key(k, 12) for k in _keys(24_000, seed=1))
    assert min(counts.values()) > 0.85 * 2000 and max(counts.values()) < 1.15 * 2000, counts


def test_placement_matches_the_pure_function_and_groups_keys_in_order() -> None:
    nodes = tuple(
        NodeConfig(f"n{i:02d}", f"127.0.0.1:{5000 + i}", 0, f"n{i:02d}", f"/d/{i}")
        for i in range(13)
    )
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], WIDTH)
    placement = Placement(ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups)))
    keys = _keys(200, seed=2)
    by_group = placement.keys_by_group(keys)
    for group_index, positions in by_group.items():
        assert positions == sorted(positions)
        for position in positions:
            assert group_of_key(keys[position], 13) == group_index
            assert placement.nodes_for_key(keys[position]) == groups[group_index]
    assert sorted(p for ps in by_group.values() for p in ps) == list(range(200))


@pytest.mark.parametrize("bad_key", [b"short", b"x" * 17, "a" * 16, bytearray(16)])
def test_bad_keys_are_rejected_with_advice(bad_key: object) -> None:
    with pytest.raises(InvalidArgument, match="block_keys"):
        check_key(bad_key)


def test_local_cluster_groups_are_rotations_of_the_node_list() -> None:
    ids = [f"n{i:02d}" for i in range(12)]
    groups = make_groups([(i, i) for i in ids], WIDTH)
    assert len(groups) == 12
    for g, group in enumerate(groups):
        assert list(group) == ids[g:] + ids[:g], "group g should be the ring rotated by g"
    for position in range(WIDTH):
        assert sorted(group[position] for group in groups) == ids, (
            "each node should hold every shard index exactly once"
        )


@pytest.mark.parametrize(("num_nodes", "num_domains"), [(12, 12), (17, 17), (26, 13), (24, 12)])
def test_groups_never_share_a_domain_when_domains_allow(num_nodes: int, num_domains: int) -> None:
    node_to_domain = [(f"n{i:02d}", f"host{i % num_domains}") for i in range(num_nodes)]
    domain_of = dict(node_to_domain)
    groups = make_groups(node_to_domain, WIDTH)
    for group in groups:
        assert len(group) == WIDTH and len(set(group)) == WIDTH
        assert len({domain_of[n] for n in group}) == WIDTH, f"two shards share a domain: {group}"
    uses = Counter(n for group in groups for n in group)
    assert set(uses) == set(domain_of), "some node holds no shard"
    assert max(uses.values()) - min(uses.values()) <= 1, f"unbalanced slots: {uses}"


def test_fewer_domains_than_shards_spread_evenly() -> None:
    node_to_domain = [(f"n{i:02d}", f"host{i % 4}") for i in range(16)]
    domain_of = dict(node_to_domain)
    for group in make_groups(node_to_domain, WIDTH):
        per_domain = Counter(domain_of[n] for n in group)
        assert max(per_domain.values()) == 3, f"4 hosts should get 3 shards each: {per_domain}"


def test_too_few_nodes_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="at least 12"):
        make_groups([(f"n{i}", f"n{i}") for i in range(11)], WIDTH)
