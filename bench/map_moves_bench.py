"""``kvstore bench map-moves``: shards a map change moves, against the fewest it could.

::

    kvstore bench map-moves [--nodes 12] [--keys 100000] [--seed 15] [--json PATH]

Pure placement arithmetic (no cluster): ``--keys`` random 16-byte keys are placed in a map of
``--nodes`` nodes (each its own failure domain, groups from kvstore.placement.make_groups);
then, for each change, the shards whose node differs are counted (kvstore.map_changes):

* join: one node added by moving slots (the newcomer's fair share is the ideal);
* join by regeneration: the same node list with groups made from scratch (what a map
  generator run again would do, for comparison);
* drain: one node's slots given away (its own shards are the ideal);
* out: the same for a node marked out after ``down_out_s``;
* to weights: 4 nodes get half the byte limit of the others (kvstore/placement_weights.py),
  by the limits alone (groups weighted in rendezvous), and by each fit of ``kvstore cluster
  reweight`` (kvstore/reweight.py: slots handed over in the same change, then group weights
  fitted exactly, kept equal, or, the default, corrected within the ideal's budget), once
  for the last 4 nodes and once for 4 spread over the ring; the ideal is the shards the
  nodes whose share grows gain in the fully weighted map (the ``worst_share_over_weight``
  field says how close each gets);
* in a weighted map (the same 4 half nodes, groups drawn by weight): a join, a drain and an
  out, each with the map's group weights kept (what kvstore/map_changes.py does) and refitted
  to the new slots (what placement did before maps kept them: keys change group). The ideal
  is the newcomer's shards for the join and the node's own shards for the drain and the out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from erasure.config import CodecConfig
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.map_changes import (
    MoveCount,
    drain,
    finish_move,
    held_shards,
    ideal_join_shards,
    join,
    mark_out,
    shards_moved,
)
from kvstore.placement import make_groups
from kvstore.placement_weights import map_group_weights, node_weights, share_report
from kvstore.reweight import FITS, reweight, share_gain

GiB = 1 << 30
WEIGHTED_SMALL = 4  # nodes given half the byte limit in the weight rows
# The weight rows' smallest map: with 12 nodes in groups of 12 every group holds every node,
# so weights can shift nothing (each node holds one shard of every block).
WEIGHTED_NODES = 24


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=12, help="nodes in the map before the joins")
    parser.add_argument("--keys", type=int, default=100_000, help="random keys placed")
    parser.add_argument("--seed", type=int, default=15, help="seed of the keys")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")


def run(args: argparse.Namespace) -> int:
    try:
        rows = measure_moves(args.nodes, args.keys, args.seed)
        rows += measure_weight_moves(max(args.nodes, WEIGHTED_NODES), args.keys, args.seed)
        rows += measure_weighted_changes(max(args.nodes, WEIGHTED_NODES), args.keys, args.seed)
    except ValueError as exc:
        print(f"kvstore bench map-moves: {exc}", file=sys.stderr)
        return 2
    print(
        f"{'change':<62} {'moved shards':>13} {'ideal':>9} {'ratio':>6} {'keys touched':>13} "
        f"{'share/weight':>12}"
    )
    for row in rows:
        worst = row.get("worst_share_over_weight")
        print(
            f"{row['change']:<62} {row['moved_shards']:>13,} {row['ideal_shards']:>9,} "
            f"{row['ratio_to_ideal']:>6.3f} {row['keys_touched']:>13,} "
            f"{'' if worst is None else f'{worst:.3f}':>12}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"nodes": args.nodes, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _node(i: int) -> NodeConfig:
    return NodeConfig(f"n{i:02d}", f"127.0.0.1:{20000 + i}", 0, f"host{i:02d}", f"/tmp/n{i:02d}")


def measure_moves(num_nodes: int, num_keys: int, seed: int) -> list[dict[str, Any]]:
    """One row per change (see the module docstring)."""
    codec = CodecConfig()
    if num_nodes < codec.num_shards or num_keys < 1:
        raise ValueError(
            f"--nodes must be at least k+m = {codec.num_shards} and --keys at least 1, got "
            f"{num_nodes} and {num_keys}"
        )
    keys = np.random.default_rng(seed).integers(0, 256, (num_keys, 16), dtype=np.uint8)
    nodes = tuple(_node(i) for i in range(num_nodes))
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], codec.num_shards)
    before = ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=codec)
    joined = join(before, _node(num_nodes))
    regenerated = dataclasses.replace(
        joined,
        groups=tuple(
            make_groups([(n.id, n.failure_domain) for n in joined.nodes], codec.num_shards)
        ),
        moving_from=(),
    )
    settled = finish_move(joined)
    num_shards = num_keys * codec.num_shards
    ideal_join = ideal_join_shards(num_shards, num_nodes + 1)
    changes = [
        ("join", before, joined, ideal_join),
        ("join by regenerating groups", before, regenerated, ideal_join),
        ("drain", settled, drain(settled, "n01"), held_shards(settled, "n01", keys)),
        (
            "out (down past down_out_s)",
            settled,
            mark_out(settled, "n02"),
            held_shards(settled, "n02", keys),
        ),
    ]
    return [_row(name, shards_moved(old, new, keys, ideal)) for name, old, new, ideal in changes]


def measure_weight_moves(num_nodes: int, num_keys: int, seed: int) -> list[dict[str, Any]]:
    """Moving a map to capacity weights: ``WEIGHTED_SMALL`` of ``num_nodes`` equal nodes get
    half the byte limit, the last ones (neighbours in the ring, so some groups hold all of
    them) and then ones spread over the ring. The ideal is the shards the nodes' shares gain
    in the fully weighted map (``--fit exact``), summed; rows: the limits alone (groups
    weighted in rendezvous, slots kept), then each ``kvstore cluster reweight --fit``
    (kvstore/reweight.py)."""
    codec = CodecConfig()
    keys = np.random.default_rng(seed).integers(0, 256, (num_keys, 16), dtype=np.uint8)
    nodes = tuple(_node(i) for i in range(num_nodes))
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], codec.num_shards)
    before = ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=codec)
    last = range(num_nodes - WEIGHTED_SMALL, num_nodes)
    spread = range(3, num_nodes, num_nodes // WEIGHTED_SMALL)
    rows = []
    for layout, small in (("", last), (", spread", spread)):
        limits = {n.id: GiB // 2 if i in small else GiB for i, n in enumerate(nodes)}
        exact = reweight(before, limits, "exact")
        ideal = share_gain(before, exact, keys)  # what the change in weights requires
        changes = [(f"--fit {fit}", reweight(before, limits, fit), ideal) for fit in FITS]
        if not layout:
            weighted = dataclasses.replace(exact, groups=before.groups, group_weights=())
            limits_only = ("limits only", weighted, share_gain(before, weighted, keys))
            changes.insert(0, limits_only)
        for name, new, row_ideal in changes:
            label = f"to weights ({WEIGHTED_SMALL} half nodes{layout}), {name}"
            row = _row(label, shards_moved(before, new, keys, row_ideal))
            row["worst_share_over_weight"] = round(_worst_share_over_weight(new), 4)
            rows.append(row)
    return rows


def _worst_share_over_weight(cfg: ClusterConfig) -> float:
    """The largest node share of the shards against its share of the byte limits."""
    shares = share_report(cfg.nodes, cfg.groups, map_group_weights(cfg))
    return max(share / weight for share, weight in shares.values() if weight > 0)


def measure_weighted_changes(num_nodes: int, num_keys: int, seed: int) -> list[dict[str, Any]]:
    """Join, drain and out in a map whose last ``WEIGHTED_SMALL`` nodes have half the byte
    limit, with the group weights kept and refitted (module docstring)."""
    codec = CodecConfig()
    keys = np.random.default_rng(seed).integers(0, 256, (num_keys, 16), dtype=np.uint8)
    nodes = tuple(
        dataclasses.replace(
            _node(i), max_bytes=GiB // 2 if i >= num_nodes - WEIGHTED_SMALL else GiB
        )
        for i in range(num_nodes)
    )
    pairs = [(n.id, n.failure_domain) for n in nodes]
    groups = make_groups(pairs, codec.num_shards, None, node_weights(nodes))
    cfg = ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=codec)
    newcomer = dataclasses.replace(_node(num_nodes), max_bytes=GiB)
    joined = join(cfg, newcomer)
    changes = [
        ("join", joined, held_shards(joined, newcomer.id, keys)),
        ("drain", drain(cfg, "n01"), held_shards(cfg, "n01", keys)),
        ("out", mark_out(cfg, "n02"), held_shards(cfg, "n02", keys)),
    ]
    rows = []
    for name, new, ideal in changes:
        refitted = dataclasses.replace(new, group_weights=())
        for how, after in (("weights kept", new), ("weights refitted", refitted)):
            label = f"weighted map: {name}, {how}"
            rows.append(_row(label, shards_moved(cfg, after, keys, ideal)))
    return rows


def _row(name: str, count: MoveCount) -> dict[str, Any]:
    return {
        "change": name,
        "keys": count.num_keys,
        "shards": count.num_shards,
        "moved_shards": count.moved_shards,
        "ideal_shards": count.ideal_shards,
        "ratio_to_ideal": round(count.ratio_to_ideal, 4),
        "keys_touched": count.moved_keys,
    }
