"""Capacity weights: a node with half the space holds about half the shards (issue 38).

Pure code: no I/O, no clock. kvstore/placement.py uses it; so do the status, the bench and the
planner, so they all see the shares the data path places by.

A node's **weight** is its byte limit, ``max_bytes``; a node without one (0: the disk's free
space, which no map records) weighs the mean of those that have one. When every node weighs
the same, placement is plain rendezvous, exactly as before weights existed.

Keys go to *groups*, not nodes, so node weights become **group weights**: ``x_g`` such that a
node's expected share of every key's shards, ``sum of p_g over the groups it is in`` (with
``p_g = x_g / sum(x)``), is proportional to its weight. They are fitted by multiplicative
updates (each group scaled by the geometric mean, over its members, of target / share); where
the groups make the targets reachable this converges to them, elsewhere to the nearest the
groups allow (a 12-node cluster with groups of 12 cannot shift anything: every group holds
every node). The weights are rounded to integers (``WEIGHT_SCALE`` steps), so every process
ranks groups alike. A key then picks its group by weighted rendezvous, the highest
``x_g / -ln(u_g)`` where ``u_g`` is ``xxh3_64(group_id || key)`` scaled to (0, 1): group ``g``
wins a share ``p_g`` of the keys, and changing weights moves only the keys the change requires
(those a group gains come from the groups that lose them).

**The map keeps its weights.** Fitted weights depend on every slot, so a drain, an out or a
join would refit them and move keys between groups: in a 24-node map with 4 half nodes, 21%
of the keys changed group on a drain (5.4x the shards the drain itself requires), and a read
during the move looks for a key's shards in its *new* group's old members, so they read as
misses. A map records the weights it places by (``ClusterConfig.group_weights``, ``weight``
in each ``[[groups]]`` entry) and every map change keeps them (kvstore/map_changes.py), so
a change moves only the slots it hands over; a map without them derives them from the byte
limits as above (:func:`map_group_weights`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from kvstore.config import ClusterConfig, NodeConfig

FIT_ITERATIONS = 200
FIT_TOLERANCE = 1e-4  # a node's share within this fraction of its target: fitted
WEIGHT_SCALE = 1 << 20  # the heaviest group's integer weight


def node_weights(nodes: Sequence[NodeConfig]) -> dict[str, float]:
    """Node id -> its weight: ``max_bytes``, or the mean of the set ones where it is 0."""
    configured = [n.max_bytes for n in nodes if n.max_bytes > 0]
    fill = sum(configured) / len(configured) if configured else 1.0
    return {n.id: float(n.max_bytes or fill) for n in nodes}


def group_weights(
    groups: Sequence[Sequence[str]], node_to_weight: Mapping[str, float]
) -> tuple[int, ...] | None:
    """Integer weight of each group (module docstring); None when every node of the groups
    weighs the same (plain rendezvous: no group is favoured)."""
    members = {n for group in groups for n in group}
    if len({node_to_weight[n] for n in members}) <= 1:
        return None
    total = sum(node_to_weight[n] for n in members)
    width = sum(len(g) for g in groups) / len(groups)
    target = {n: width * node_to_weight[n] / total for n in members}
    x = [1.0] * len(groups)
    for _ in range(FIT_ITERATIONS):
        share = node_shares(groups, x)
        if all(abs(share[n] / target[n] - 1) < FIT_TOLERANCE for n in members):
            break
        x = [
            xg * math.exp(sum(math.log(target[n] / share[n]) for n in g) / len(g))
            for xg, g in zip(x, groups, strict=True)
        ]
        top = max(x)
        x = [xg / top for xg in x]
    return tuple(max(1, round(xg * WEIGHT_SCALE)) for xg in x)


def map_group_weights(config: ClusterConfig) -> tuple[int, ...] | None:
    """The group weights a map places by: those it records (None when all are equal: plain
    rendezvous), else derived from its nodes' byte limits; None means equal."""
    if config.group_weights:
        equal = len(set(config.group_weights)) == 1
        return None if equal else config.group_weights
    return group_weights(config.groups, node_weights(config.nodes))


def kept_weights(old: ClusterConfig, new: ClusterConfig) -> tuple[int, ...]:
    """``group_weights`` for ``new`` (a map change of ``old``: same groups, slots moved) that
    place every key in the group ``old`` placed it in: () where ``new``'s own derivation gives
    the same, else ``old``'s weights (all 1 for plain rendezvous)."""
    weights = map_group_weights(old)
    if map_group_weights(dataclasses.replace(new, group_weights=())) == weights:
        return ()
    return weights or (1,) * len(old.groups)


def node_shares(
    groups: Sequence[Sequence[str]], weights: Sequence[float] | None
) -> dict[str, float]:
    """Node id -> shards it holds per key placed, on average (sums to the group width):
    the groups' probabilities ``p_g`` summed over the groups it is in."""
    x = [1.0] * len(groups) if weights is None else weights
    total = sum(x)
    share: dict[str, float] = {}
    for xg, group in zip(x, groups, strict=True):
        for node_id in group:
            share[node_id] = share.get(node_id, 0.0) + xg / total
    return share


def share_report(
    nodes: Sequence[NodeConfig],
    groups: Sequence[Sequence[str]],
    weights: Sequence[float] | None,
) -> dict[str, tuple[float, float]]:
    """Node id -> (its fraction of the shards placement gives it with these group weights
    (None: equal), its fraction of the byte limits' weight): what ``kvstore cluster status``
    shows. Nodes in no group hold 0."""
    node_to_weight = node_weights(nodes)
    shares = node_shares(groups, weights)
    placed = [n for n in nodes if n.id in shares]
    total_share = sum(shares.values())
    total_weight = sum(node_to_weight[n.id] for n in placed)
    return {
        n.id: (
            shares.get(n.id, 0.0) / total_share,
            node_to_weight[n.id] / total_weight if n.id in shares else 0.0,
        )
        for n in nodes
    }


def rebalance_slots(
    groups: Sequence[Sequence[str]],
    node_to_domain: Mapping[str, str],
    node_to_weight: Mapping[str, float],
    max_hand_overs: int | None = None,
) -> list[tuple[str, ...]]:
    """The groups with slots handed from nodes above their weight's share of the slots to
    nodes below it, one slot at a time, until no hand-over brings the two closer (or after
    ``max_hand_overs``): moving an existing map to weights. Each hand-over moves the shards
    of one slot, only those; a node never enters a group twice, nor a group that already has
    its failure domain (unless it had the leaving node's). Deterministic: ties go to the
    lowest node id, then group index.
    """
    new = [list(g) for g in groups]
    members = sorted({n for g in groups for n in g})
    total = sum(node_to_weight[n] for n in members)
    num_slots = sum(len(g) for g in groups)
    target = {n: num_slots * node_to_weight[n] / total for n in members}
    count = {n: sum(g.count(n) for g in new) for n in members}
    num_hand_overs = 0
    while max_hand_overs is None or num_hand_overs < max_hand_overs:
        over = max(members, key=lambda n: (count[n] - target[n], n))
        if not _hand_over(new, over, count, target, node_to_domain):
            break
        num_hand_overs += 1
    return [tuple(g) for g in new]


def _hand_over(
    groups: list[list[str]],
    giver: str,
    count: dict[str, int],
    target: Mapping[str, float],
    node_to_domain: Mapping[str, str],
) -> bool:
    """Move one of ``giver``'s slots to the node furthest under its target that can take it
    and ends closer to it; False when none can."""
    for taker in sorted(count, key=lambda n: (count[n] - target[n], n)):
        if (count[giver] - target[giver]) - (count[taker] - target[taker]) <= 1:
            return False
        for group in groups:
            if giver not in group or taker in group:
                continue
            domains = {node_to_domain[n] for n in group if n != giver}
            if node_to_domain[taker] in domains:
                continue
            group[group.index(giver)] = taker
            count[giver] -= 1
            count[taker] += 1
            return True
    return False
