"""Moving a map placed by equal groups to capacity weights: ``kvstore cluster reweight``.

Pure code: no I/O, no clock (kvstore/placement_weights.py has the weights themselves).

**What can move.** A change hands *slots* over (group g, position i: the slot's shards move,
and repair fills the new member while reads fall back to the old one) and may change *group
weights* (keys change group; every shard of such a key moves, and it reads as a miss until
written again: the move is not read-through). Slots are the cheap tool, one shard moved per
shard of share changed, but they are whole: in a 24-node map with 4 half nodes a small node's
fair 6.55 of 288 slots becomes 7, 6.9% over its weight. Only group weights can correct that
residual, and each key they move carries its 12 shards for the one or few shards of share it
corrects. The fits, all after :func:`~kvstore.placement_weights.rebalance_slots`:

* ``"budget"`` (the default): the residual corrected as far as the shards the change in
  weights requires allow (the *ideal*: what the nodes whose share grows gain, summed). One
  set of groups, those holding the most share above target, is scaled down by one factor;
  with one factor a key only ever leaves that set, so the keys moved are the fewest for the
  shift (``p_L - p'_L``) and the shards they carry are known exactly (:func:`expected_moves`).
  Each leading run of the groups ranked by excess, and factors down to the budget's, are
  tried; the one leaving the worst node least over its weight wins.
* ``"exact"``: the group weights fitted to the targets (``group_weights``): each node's share
  is its weight's (1.30x the ideal in the 24-node example: keys change group wholesale).
* ``"slots"``: the groups kept equal; only the handed-over slots move (0.92x there), and
  all of them, even where whole slots overshoot the ideal (1.07x for 2 half nodes of 16).

The figures are in docs/multi-host.md (``kvstore bench map-moves``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import InvalidArgument
from kvstore.map_changes import changed_slots, held_shards, shards_moved
from kvstore.placement import groups_of_keys
from kvstore.placement_weights import (
    WEIGHT_SCALE,
    group_weights,
    map_group_weights,
    node_shares,
    node_weights,
    rebalance_slots,
    share_report,
)

FITS = ("budget", "exact", "slots")
# The share of the ideal the budget fit's group weights may bring the moves to (the slots may
# take all of it: their moves are exact): a sample of 100,000 keys (the bench's) reads moves
# and ideal within about 0.5% of their expectations, so this keeps it under 1.0 there.
BUDGET_FRACTION = 0.99
RATIO_STEPS = 64  # factors tried per set of groups (bisection steps, then a grid)

Groups = Sequence[Sequence[str]]


def reweight(
    cfg: ClusterConfig, node_to_max_bytes: Mapping[str, int] | None = None, fit: str = "budget"
) -> ClusterConfig:
    """The next map of ``cfg`` placed by its nodes' byte limits (``node_to_max_bytes``
    changes some first): slots handed over and group weights per ``fit`` (module docstring),
    the old groups kept in ``moving_from`` so repair fills the new slots. Raises
    InvalidArgument, changing nothing, for a map that is moving or already weighted, an
    unknown node or fit, or limits that leave nothing to move."""
    nodes = _limited_nodes(cfg, node_to_max_bytes or {}, fit)
    members = {n for g in cfg.groups for n in g}
    node_to_weight = {n: w for n, w in node_weights(nodes).items() if n in members}
    if len(set(node_to_weight.values())) <= 1:
        raise InvalidArgument(
            "every node in a group has the same byte limit, so there is no weight to move to; "
            "set the limits that differ with --max-bytes NODE=SIZE,..."
        )
    domains = {n.id: n.failure_domain for n in nodes}
    groups = tuple(tuple(g) for g in rebalance_slots(cfg.groups, domains, node_to_weight))
    exact = group_weights(groups, node_to_weight) or (1,) * len(groups)
    if fit == "exact":
        weights = exact
    elif fit == "slots":
        weights = (1,) * len(groups)
    else:
        ideal = ideal_moves(cfg.groups, groups, exact)
        groups, weights = _budget_fit(cfg.groups, domains, node_to_weight, ideal)
    moved = groups != cfg.groups
    return dataclasses.replace(
        cfg,
        epoch=cfg.epoch + 1,
        nodes=nodes,
        groups=groups,
        moving_from=cfg.groups if moved else (),
        group_weights=weights,
    )


def _budget_fit(
    old: Groups, domains: Mapping[str, str], node_to_weight: Mapping[str, float], ideal: float
) -> tuple[Groups, tuple[int, ...]]:
    """The ``"budget"`` fit's groups and weights. A slot of equal groups carries 1/G of the
    shards per key, so the ideal pays for ``floor(ideal * G)`` hand-overs; but hand-overs that
    do not lower the worst node (some small nodes at 6 slots while others stay at 7) spend
    budget that group weights could use, so the fewest hand-overs with the same worst node
    are tried too, and the better result kept."""
    most = int(ideal * len(old) + 1e-9)  # 1e-9: a float sum of a whole number of slots
    target = targets(old, node_to_weight)
    options = []
    for num_hand_overs in sorted({_fewest_for_worst(old, domains, node_to_weight, most), most}):
        groups = tuple(map(tuple, rebalance_slots(old, domains, node_to_weight, num_hand_overs)))
        budget = max(BUDGET_FRACTION * ideal, len(changed_slots(old, groups)) / len(old))
        weights = budget_weights(old, groups, node_to_weight, budget)
        options.append((_worst(groups, weights, target), groups, weights))
    _, groups, weights = min(options, key=lambda option: option[0])
    return groups, weights


def _fewest_for_worst(
    old: Groups, domains: Mapping[str, str], node_to_weight: Mapping[str, float], most: int
) -> int:
    """The fewest hand-overs leaving the worst node where ``most`` leave it (the greedy hands
    over from the node furthest over first, so the worst falls step by step: bisection)."""
    target = targets(old, node_to_weight)

    def worst_after(num: int) -> float:
        return _worst(rebalance_slots(old, domains, node_to_weight, num), None, target)

    goal, low, high = worst_after(most), -1, most  # worst_after(high) == goal
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if worst_after(middle) <= goal + 1e-12 else (middle, high)
    return high


def _limited_nodes(
    cfg: ClusterConfig, node_to_max_bytes: Mapping[str, int], fit: str
) -> tuple[NodeConfig, ...]:
    """``cfg``'s nodes with the new limits, after checking the request (nothing changed yet)."""
    if fit not in FITS:
        raise InvalidArgument(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
    if cfg.moving_from:
        raise InvalidArgument(
            f"cannot reweight: the map change of epoch {cfg.epoch} is still moving shards; "
            "wait until `kvstore cluster status` shows no move"
        )
    if map_group_weights(cfg) is not None:
        raise InvalidArgument(
            "the map is already placed by unequal group weights; reweight moves a map placed "
            "by equal groups (changing the weights of a weighted map is not supported yet)"
        )
    known = {n.id for n in cfg.nodes}
    unknown = sorted(set(node_to_max_bytes) - known)
    if unknown:
        raise InvalidArgument(f"no node {', '.join(unknown)} in the map (nodes: {sorted(known)})")
    bad = {n: b for n, b in node_to_max_bytes.items() if type(b) is not int or b <= 0}
    if bad:
        raise InvalidArgument(f"a byte limit must be a positive size like 512MiB, got {bad}")
    return tuple(
        dataclasses.replace(n, max_bytes=node_to_max_bytes.get(n.id, n.max_bytes))
        for n in cfg.nodes
    )


def targets(groups: Groups, node_to_weight: Mapping[str, float]) -> dict[str, float]:
    """Node id -> the shards per key its weight entitles it to (sums to the group width)."""
    members = {n for g in groups for n in g}
    total = sum(node_to_weight[n] for n in members)
    width = sum(map(len, groups)) / len(groups)
    return {n: width * node_to_weight[n] / total for n in members}


def ideal_moves(old: Groups, new: Groups, new_weights: Sequence[int]) -> float:
    """Shards per key the change in weights requires from equal groups ``old`` to the fully
    weighted map (``new`` and its fitted ``new_weights``, the nearest the groups allow to the
    weights): what the nodes whose share grows gain, summed (``kvstore bench map-moves``'s
    ideal)."""
    before, after = node_shares(old, None), node_shares(new, new_weights)
    return sum(max(0.0, after[n] - before.get(n, 0.0)) for n in after)


def expected_moves(old: Groups, new: Groups, scaled: Sequence[int], ratio: float) -> float:
    """Shards per key moved from equal groups ``old`` to ``new`` whose groups ``scaled`` have
    weight ``ratio`` (< 1) and the others 1, in expectation over keys.

    Weighted rendezvous is an exponential race: with one set ``L`` scaled by one factor, a key
    only leaves ``L``, a fraction ``p_L - p'_L``, and which group of ``L`` it leaves and which
    of the rest it joins are independent (argmin and min of exponentials are), so the flow
    from ``a`` to ``b`` is ``(p_a / p_L) (p_b / p_N) (p_L - p'_L)``. A key that stays moves
    its group's changed slots; one that moves, every position whose node differs."""
    return _MoveCurve(old, new)(scaled, ratio)


class _MoveCurve:
    """:func:`expected_moves` for many sets and factors: what depends on neither (each
    group's changed slots, the positions differing between every old and new group) once."""

    def __init__(self, old: Groups, new: Groups) -> None:
        old_nodes, new_nodes = np.array(old), np.array(new)  # [G, width] each
        self.changed = (old_nodes != new_nodes).sum(axis=1)  # [G]
        self.differing = (old_nodes[:, None, :] != new_nodes[None, :, :]).sum(axis=2)  # [G, G]

    def __call__(self, scaled: Sequence[int], ratio: float) -> float:
        num_groups = len(self.changed)
        in_l = np.zeros(num_groups, bool)
        in_l[list(scaled)] = True
        num_l = int(in_l.sum())
        p_l = num_l / num_groups
        left = p_l - ratio * num_l / (ratio * num_l + num_groups - num_l)  # keys leaving L
        stay = np.where(in_l, 1 - left / p_l if num_l else 1.0, 1.0) / num_groups
        moved = float((stay * self.changed).sum())
        if not left:
            return moved
        return moved + left * float(self.differing[in_l][:, ~in_l].mean())


def budget_weights(
    old: Groups, new: Groups, node_to_weight: Mapping[str, float], budget: float
) -> tuple[int, ...]:
    """Integer group weights for ``new`` (slots handed over from equal groups ``old``) that
    leave the worst node least over its weight while moving at most ``budget`` shards per key
    in expectation (module docstring); all 1 when no scaling helps."""
    target = targets(new, node_to_weight)
    share = node_shares(new, None)
    # A group's excess: how far over their weight its members are, summed (those under
    # count 0: the objective is the node furthest over).
    excess = [sum(max(0.0, share[n] / target[n] - 1) for n in g) for g in new]
    ranked = [g for g in sorted(range(len(new)), key=lambda g: (-excess[g], g)) if excess[g]]
    best = (_worst(new, None, target), -1.0, (), 1.0)  # worst, -ratio, scaled, ratio
    curve = _MoveCurve(old, new)
    for size in range(1, min(len(ranked) + 1, len(new))):
        scaled = tuple(sorted(ranked[:size]))
        for ratio in _ratios_within(curve, scaled, budget):
            weights = _scaled_weights(len(new), scaled, ratio)
            candidate = (_worst(new, weights, target), -ratio, scaled, ratio)
            best = min(best, candidate)
    _, _, scaled, ratio = best
    return _scaled_weights(len(new), scaled, ratio)


def _ratios_within(curve: _MoveCurve, scaled: Sequence[int], budget: float) -> list[float]:
    """Factors for ``scaled`` from 1 down to the smallest whose moves stay within ``budget``
    (moves grow as the factor falls: bisection), evenly spaced."""
    if curve(scaled, 1.0) > budget:
        return []
    low, high = 0.0, 1.0  # high: within the budget
    for _ in range(RATIO_STEPS // 2):
        middle = (low + high) / 2
        if curve(scaled, middle) <= budget:
            high = middle
        else:
            low = middle
    return list(np.linspace(high, 1.0, RATIO_STEPS // 2))


def _scaled_weights(num_groups: int, scaled: Sequence[int], ratio: float) -> tuple[int, ...]:
    scaled_weight = max(1, round(ratio * WEIGHT_SCALE))
    chosen = set(scaled)
    return tuple(scaled_weight if g in chosen else WEIGHT_SCALE for g in range(num_groups))


def _worst(groups: Groups, weights: Sequence[int] | None, target: Mapping[str, float]) -> float:
    """The largest node share against its target (1.0: every node at its weight)."""
    share = node_shares(groups, weights)
    return max(share[n] / target[n] for n in target)


def share_gain(old: ClusterConfig, new: ClusterConfig, keys: np.ndarray) -> int:
    """Shards of ``keys`` (uint8 [n, 16]) that the nodes whose share grows gain from ``old``
    to ``new``, summed: the fewest any move between them could move."""
    gains = [held_shards(new, n.id, keys) - held_shards(old, n.id, keys) for n in new.nodes]
    return sum(g for g in gains if g > 0)


def move_report(
    old: ClusterConfig, new: ClusterConfig, num_keys: int = 100_000, seed: int = 0
) -> dict[str, Any]:
    """What moving ``old`` to ``new`` (a :func:`reweight`) moves, over ``num_keys`` random
    keys: shards moved against the ideal (the share gain of the fully weighted map, as
    ``kvstore bench map-moves`` counts it), keys that change group (they read as misses until
    written again), slots handed over, and each node's share of the shards against its
    weight: what ``kvstore cluster reweight --dry-run`` prints."""
    keys = np.random.default_rng(seed).integers(0, 256, (num_keys, 16), dtype=np.uint8)
    limits = {n.id: n.max_bytes for n in new.nodes if n.max_bytes}
    ideal = share_gain(old, reweight(old, limits, "exact"), keys)
    count = shards_moved(old, new, keys, ideal)
    old_groups = groups_of_keys(keys, len(old.groups), map_group_weights(old))
    new_groups = groups_of_keys(keys, len(new.groups), map_group_weights(new))
    shares = share_report(new.nodes, new.groups, map_group_weights(new))
    return {
        "epoch": [old.epoch, new.epoch],
        "keys": num_keys,
        "slots_moved": len(changed_slots(old.groups, new.groups)),
        "slots": sum(map(len, new.groups)),
        "moved_shards": count.moved_shards,
        "ideal_shards": count.ideal_shards,
        "ratio_to_ideal": round(count.ratio_to_ideal, 4),
        "keys_regrouped": int((old_groups != new_groups).sum()),
        "worst_share_over_weight": round(max(s / w for s, w in shares.values() if w), 4),
        "nodes": [
            {
                "id": n.id,
                "max_bytes": n.max_bytes,
                "share": round(shares[n.id][0], 5),
                "weight": round(shares[n.id][1], 5),
                "share_over_weight": round(shares[n.id][0] / shares[n.id][1], 4)
                if shares[n.id][1]
                else None,
            }
            for n in new.nodes
        ],
    }
