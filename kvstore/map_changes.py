"""Changing the cluster map: join, drain, out (a down node replaced), finish, remove.

Pure functions from one :class:`~kvstore.config.ClusterConfig` to the next, each bumping the
epoch; kvstore/membership.py stores the results in etcd and the CLI calls them.

**What moves.** A key's group comes from rendezvous hashing over the group ids
(kvstore/placement.py), and a change never adds, removes or reorders groups, so no key ever
changes group. A change only gives some group *slots* (group g, shard position i) to another
node; the shards that move are exactly those slots' shards:

* ``drain`` / ``mark_out``: each slot the node holds goes to the eligible node whose failure
  domain is least represented in that group, then the one holding the fewest slots, then the
  highest rendezvous score of (node, group, position). Moved = the node's own shards, the
  minimum any placement can do.
* ``join``: the newcomer takes ``floor(slots / nodes)`` slots, each from the most loaded
  holder among groups where the newcomer's domain stays least represented (rendezvous score
  again breaking ties). Moved = the newcomer's fair share, the minimum for balance.

Regenerating groups from scratch (``make_groups`` on the new node list) would move most slots;
:func:`shards_moved` measures either against the ideal (tests/kvstore/test_map_changes.py).

Group weights (capacity-aware placement, kvstore/placement_weights.py) are kept too: every
change records the weights its map placed by when the new map would derive others from its
slots (``ClusterConfig.group_weights``), so a change in a weighted map moves only its slots.

**During a change** ``moving_from`` holds the groups before it: writes go to ``groups``,
reads consult ``groups`` and, for a key they miss, ``moving_from``; repair fills the new
members. :func:`finish_move` (once every new member holds its shards, verified by listing:
kvstore/membership.py) clears it, and the nodes that gave slots away become ``left``; only a
``left`` node may be removed from the map, so no shard is dropped before its copy exists.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import InvalidArgument
from kvstore.placement import groups_of_keys
from kvstore.placement_weights import kept_weights, map_group_weights

Groups = tuple[tuple[str, ...], ...]


def join(cfg: ClusterConfig, node: NodeConfig) -> ClusterConfig:
    """The map with ``node`` added ("in") and given its fair share of slots."""
    _require_settled(cfg, f"join {node.id}")
    if node.id in {n.id for n in cfg.nodes}:
        raise InvalidArgument(
            f"node {node.id!r} is already in the map (state "
            f"{cfg.node(node.id).state!r}); remove it first or choose another id"
        )
    if node.state != "in":
        node = dataclasses.replace(node, state="in")
    nodes = (*cfg.nodes, node)
    domain_of = {n.id: n.failure_domain for n in nodes}
    groups = [list(g) for g in cfg.groups]
    load = Counter(n for g in groups for n in g)
    num_in = sum(n.state == "in" for n in nodes)
    for _ in range(sum(map(len, groups)) // num_in):
        best: tuple[tuple[int, int, int], int, int] | None = None
        for g, members in enumerate(groups):
            if node.id in members:
                continue
            domains = Counter(domain_of[m] for m in members)
            for position, holder in enumerate(members):
                after = domains[node.failure_domain] + (domain_of[holder] != node.failure_domain)
                rank = (after, -load[holder], -_score(node.id, g, position))
                if best is None or rank < best[0]:
                    best = (rank, g, position)
        if best is None or load[groups[best[1]][best[2]]] <= load[node.id] + 1:
            break  # no slot left whose move improves the balance
        _, g, position = best
        load[groups[g][position]] -= 1
        load[node.id] += 1
        groups[g][position] = node.id
    return _changed(cfg, nodes=nodes, groups=tuple(map(tuple, groups)), moving_from=cfg.groups)


def drain(cfg: ClusterConfig, node_id: str) -> ClusterConfig:
    """The map with ``node_id``'s slots given to other nodes; it serves reads of its old
    shards ("draining") until :func:`finish_move`."""
    _require_settled(cfg, f"drain {node_id}")
    return _give_away(cfg, node_id, "draining")


def mark_out(cfg: ClusterConfig, node_id: str) -> ClusterConfig:
    """The map with a down node's slots replaced ("out"; repair rebuilds them elsewhere).

    Unlike join and drain, this may happen during another move: a failure does not wait. The
    reads' fallback then stays the placement from before the first move."""
    return _give_away(cfg, node_id, "out")


def finish_move(cfg: ClusterConfig) -> ClusterConfig:
    """The map once the move is complete: no fallback placement, givers "left"."""
    if not cfg.moving_from:
        raise InvalidArgument("no map change is in progress (moving_from is empty)")
    nodes = tuple(
        dataclasses.replace(n, state="left") if n.state in ("draining", "out") else n
        for n in cfg.nodes
    )
    return _changed(cfg, nodes=nodes, moving_from=())


def remove(cfg: ClusterConfig, node_id: str) -> ClusterConfig:
    """The map without ``node_id``, which must hold no slot (drained or out, move finished)."""
    node = cfg.node(node_id)
    holds = any(node_id in g for g in (*cfg.groups, *cfg.moving_from))
    if holds or node.state != "left":
        raise InvalidArgument(
            f"node {node_id} is {node.state!r} and still holds or serves group slots; drain it "
            f"first (`kvstore cluster drain {node_id}`) and wait until it is 'left'"
        )
    return _changed(cfg, nodes=tuple(n for n in cfg.nodes if n.id != node_id))


def readdress(cfg: ClusterConfig, node_id: str, address: str, metrics_port: int) -> ClusterConfig:
    """The map with one node at a new address (a host renumbered, a port that was taken);
    its slots stay, so nothing moves."""
    node = dataclasses.replace(cfg.node(node_id), address=address, metrics_port=metrics_port)
    return _changed(cfg, nodes=tuple(node if n.id == node_id else n for n in cfg.nodes))


def _changed(cfg: ClusterConfig, **changes: Any) -> ClusterConfig:
    """The next epoch's map with ``changes``, placing every key in the group ``cfg`` did."""
    new = dataclasses.replace(cfg, epoch=cfg.epoch + 1, **changes)
    return dataclasses.replace(new, group_weights=kept_weights(cfg, new))


def _require_settled(cfg: ClusterConfig, what: str) -> None:
    if cfg.moving_from:
        moving = sorted(n.id for n in cfg.nodes if n.state in ("draining", "out"))
        raise InvalidArgument(
            f"cannot {what}: the map change of epoch {cfg.epoch} is still moving shards "
            f"(nodes {moving or 'joining'}); wait until `kvstore cluster status` shows no move"
        )


def _give_away(cfg: ClusterConfig, node_id: str, state: str) -> ClusterConfig:
    node = cfg.node(node_id)
    if node.state != "in":
        raise InvalidArgument(f"node {node_id} is {node.state!r}, not 'in': it holds no slots")
    nodes = tuple(dataclasses.replace(n, state=state) if n.id == node_id else n for n in cfg.nodes)
    eligible = [n for n in nodes if n.state == "in"]
    width = cfg.codec.num_shards
    if len(eligible) < width:
        raise InvalidArgument(
            f"taking {node_id} out leaves {len(eligible)} nodes in, fewer than k+m = {width}; "
            "join a node first (`kvstore cluster join`)"
        )
    domain_of = {n.id: n.failure_domain for n in nodes}
    groups = [list(g) for g in cfg.groups]
    load = Counter(n for g in groups for n in g)
    for g, members in enumerate(groups):
        for position, holder in enumerate(members):
            if holder != node_id:
                continue
            domains = Counter(domain_of[m] for i, m in enumerate(members) if i != position)
            candidates = [n.id for n in eligible if n.id not in members]
            best = min(
                candidates,
                key=lambda c, g=g, p=position, d=domains: (
                    d[domain_of[c]],
                    load[c],
                    -_score(c, g, p),
                ),
            )
            members[position] = best
            load[best] += 1
    groups_after = tuple(map(tuple, groups))
    return _changed(
        cfg, nodes=nodes, groups=groups_after, moving_from=cfg.moving_from or cfg.groups
    )


def _score(node_id: str, group: int, position: int) -> int:
    """Rendezvous score of a node for one slot: the tie-break every map change agrees on."""
    return xxhash.xxh3_64_intdigest(f"{node_id}/{group}/{position}".encode())


def changed_slots(old: Groups, new: Groups) -> list[tuple[int, int, str, str]]:
    """(group, position, old node, new node) of every slot whose node differs."""
    return [
        (g, i, a, b)
        for g, (old_group, new_group) in enumerate(zip(old, new, strict=True))
        for i, (a, b) in enumerate(zip(old_group, new_group, strict=True))
        if a != b
    ]


@dataclass(frozen=True)
class MoveCount:
    """Shards of a key sample whose node changed between two maps, against the ideal."""

    num_keys: int
    num_shards: int  # keys x (k + m)
    moved_shards: int
    ideal_shards: int  # the fewest a change of this kind can move (see the module docstring)
    moved_keys: int  # keys with at least one shard moved

    @property
    def ratio_to_ideal(self) -> float:
        return self.moved_shards / self.ideal_shards if self.ideal_shards else float("inf")


def shards_moved(
    old: ClusterConfig, new: ClusterConfig, keys: np.ndarray, ideal_shards: int
) -> MoveCount:
    """Count, over ``keys`` (uint8 [n, 16]), the shards whose node differs between the maps.

    Keys keep their group when the number of groups is kept; otherwise they are placed in
    each map by its own groups (so a regenerated map can be compared too)."""
    old_groups = groups_of_keys(keys, len(old.groups), map_group_weights(old))
    new_groups = groups_of_keys(keys, len(new.groups), map_group_weights(new))
    moved = np.zeros(len(keys), np.int64)
    for position in range(old.codec.num_shards):
        old_nodes = np.array([g[position] for g in old.groups])[old_groups]
        new_nodes = np.array([g[position] for g in new.groups])[new_groups]
        moved += old_nodes != new_nodes
    return MoveCount(
        num_keys=len(keys),
        num_shards=len(keys) * old.codec.num_shards,
        moved_shards=int(moved.sum()),
        ideal_shards=ideal_shards,
        moved_keys=int((moved > 0).sum()),
    )


def ideal_join_shards(num_shards: int, num_nodes_after: int) -> int:
    """A newcomer's fair share: the fewest shards a balanced join moves."""
    return num_shards // num_nodes_after


def held_shards(cfg: ClusterConfig, node_id: str, keys: np.ndarray) -> int:
    """Shards of ``keys`` that ``node_id`` holds in ``cfg``: what its drain must move."""
    groups = groups_of_keys(keys, len(cfg.groups), map_group_weights(cfg))
    per_group = np.array([sum(m == node_id for m in g) for g in cfg.groups])
    return int(per_group[groups].sum())


def slot_counts(groups: Sequence[Sequence[str]]) -> Counter[str]:
    """Node id -> group slots it holds."""
    return Counter(n for g in groups for n in g)
