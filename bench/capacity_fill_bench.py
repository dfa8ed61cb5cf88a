"""``kvstore bench capacity-fill``: what one small disk costs a cluster, with and without
capacity-aware placement (issue 38), in the simulator.

::

    kvstore bench capacity-fill [--nodes 24] [--small 4] [--small-shards 2000] [--seed 3]
                                [--json PATH]

``--nodes`` nodes (each its own failure domain, groups of k+m), ``--small`` of them with half
the space of the others (``--small-shards`` shards each, the others twice that). A fill of 3x
the small nodes' share (blocks enough that a small node at an equal share of the shards would
be sent 3x what it holds) is placed with the store's own placement
(kvstore/placement.py) and run through per-node eviction with whole-block eviction
(ttl/cluster_fill.py); then every block is read once. Rows:

* equal nodes: the same total space, every node alike (the yardstick);
* small nodes, capacity-blind: today's placement, every node an equal share;
* small nodes, weighted groups: groups drawn and weighted by byte limit (a new map);
* small nodes, rebalanced map: the capacity-blind map moved to weights (slots handed over,
  kvstore/placement_weights.py ``rebalance_slots``), as an existing cluster would be.

Each row gives the hit ratio and its distance in points from the equal-nodes row, and the
fraction of the raw space placement lets the cluster fill before its first node evicts.

``--local DIR`` runs the fill on real local clusters instead (node processes, real eviction):
equal nodes, then the small nodes as placement always weighs them; the hit ratio is the
fraction of the blocks ``contains`` finds after the fill.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from client import KVClient
from deploy.local_cluster import LocalCluster, local_config
from deploy.local_nodes import STARTUP_TIMEOUT_S
from erasure.config import CodecConfig
from kvstore.config import NodeConfig
from kvstore.placement import groups_of_keys, make_groups
from kvstore.placement_weights import group_weights, node_weights, rebalance_slots, share_report
from ttl.cluster_fill import fill_hit_ratio, usable_fraction

FILL_OVER_SMALL_SHARE = 3
LOCAL_SMALL_SHARDS = 300  # --local: a small node's limit holds this many shards
LOCAL_SHARD_OVERHEAD_BYTES = 200  # shard and record headers, names (a margin)
LOCAL_BATCH = 16


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=24, help="nodes in the cluster")
    parser.add_argument("--small", type=int, default=4, help="nodes with half the space")
    parser.add_argument("--small-shards", type=int, default=2000, help="a small node's shards")
    parser.add_argument("--seed", type=int, default=3, help="seed of the keys")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument(
        "--local",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the fill on real local clusters under DIR instead (--block-bytes blocks)",
    )
    parser.add_argument("--block-bytes", type=int, default=256 << 10, help="with --local")


def run(args: argparse.Namespace) -> int:
    try:
        if args.local is not None:
            result = measure_local(args.local, args.nodes, args.small, args.block_bytes)
            print(json.dumps(result, indent=2))
            return _write(result, args.json)
        result = measure(args.nodes, args.small, args.small_shards, args.seed)
    except ValueError as exc:
        print(f"kvstore bench capacity-fill: {exc}", file=sys.stderr)
        return 2
    print(f"fill: {result['fill_blocks']:,} blocks; cluster holds {result['cluster_blocks']:,}")
    print(f"{'cluster':<36} {'hit ratio':>9} {'vs equal':>9} {'usable':>7}")
    for row in result["rows"]:
        print(
            f"{row['cluster']:<36} {row['hit_ratio']:>9.4f} {row['points_vs_equal']:>+9.2f} "
            f"{row['usable_fraction']:>7.3f}"
        )
    return _write(result, args.json)


def _write(result: dict[str, Any], path: Path | None) -> int:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def _nodes(num_nodes: int, node_bytes: list[int]) -> list[NodeConfig]:
    return [
        NodeConfig(f"n{i:02d}", f"127.0.0.1:{20000 + i}", 0, f"host{i:02d}", "/tmp/x", max_bytes=b)
        for i, b in enumerate(node_bytes)
    ]


def measure(num_nodes: int, num_small: int, small_shards: int, seed: int) -> dict[str, Any]:
    """The rows of the module docstring."""
    width = CodecConfig().num_shards
    if num_nodes < width or not 0 < num_small < num_nodes or small_shards < 1:
        raise ValueError(f"need --nodes >= {width}, 0 < --small < --nodes and --small-shards >= 1")
    big = [2 * small_shards] * (num_nodes - num_small)
    hetero = big + [small_shards] * num_small
    total = sum(hetero)
    equal = [total // num_nodes] * num_nodes
    # Blocks that would send a small node, at an equal share, 3x what it holds.
    fill = FILL_OVER_SMALL_SHARE * small_shards * num_nodes // width
    keys = np.random.default_rng(seed).integers(0, 256, (fill, 16), dtype=np.uint8)
    rows = [
        _row("equal nodes, same total", _nodes(num_nodes, equal), keys, "blind"),
        _row("small nodes, capacity-blind", _nodes(num_nodes, hetero), keys, "blind"),
        _row("small nodes, weighted groups", _nodes(num_nodes, hetero), keys, "weighted"),
        _row("small nodes, rebalanced map", _nodes(num_nodes, hetero), keys, "rebalanced"),
    ]
    for row in rows:
        row["points_vs_equal"] = round(100 * (row["hit_ratio"] - rows[0]["hit_ratio"]), 2)
    return {
        "nodes": num_nodes,
        "small_nodes": num_small,
        "small_node_shards": small_shards,
        "fill_blocks": fill,
        "cluster_blocks": total // width,
        "rows": rows,
    }


def _row(name: str, nodes: list[NodeConfig], keys: np.ndarray, how: str) -> dict[str, Any]:
    width = CodecConfig().num_shards
    pairs = [(n.id, n.failure_domain) for n in nodes]
    weights = node_weights(nodes)
    if how == "weighted":
        groups = make_groups(pairs, width, None, weights)
    else:
        groups = make_groups(pairs, width)
    if how == "rebalanced":
        groups = rebalance_slots(groups, dict(pairs), weights)
    fitted = None if how == "blind" else group_weights(groups, weights)
    index = {n.id: i for i, n in enumerate(nodes)}
    members = [[index[n] for n in g] for g in groups]
    block_groups = groups_of_keys(keys, len(groups), fitted).tolist()
    hit_ratio = fill_hit_ratio([n.max_bytes for n in nodes], members, block_groups)
    if how == "blind":  # capacity-blind: every group alike, whatever the byte limits
        shares = share_report([_unweighted(n) for n in nodes], groups)
    else:
        shares = share_report(nodes, groups)
    usable = usable_fraction(
        {n.id: float(n.max_bytes) for n in nodes}, {n: s for n, (s, _) in shares.items()}
    )
    return {"cluster": name, "hit_ratio": round(hit_ratio, 4), "usable_fraction": round(usable, 4)}


def _unweighted(node: NodeConfig) -> NodeConfig:
    return NodeConfig(node.id, node.address, 0, node.failure_domain, node.data_dir)


def measure_local(root: Path, num_nodes: int, num_small: int, block_bytes: int) -> dict[str, Any]:
    """The same fill on real local clusters (one per row, started under ``root``): equal nodes,
    then nodes whose last ``num_small`` have half the byte limit (placement weighs them, as it
    always does). The limits make a small node hold ``LOCAL_SMALL_SHARDS`` shards."""
    width = CodecConfig().num_shards
    shard_bytes = block_bytes // CodecConfig().k + LOCAL_SHARD_OVERHEAD_BYTES
    small = LOCAL_SMALL_SHARDS * shard_bytes
    hetero = [2 * small] * (num_nodes - num_small) + [small] * num_small
    equal = [sum(hetero) // num_nodes] * num_nodes
    fill = FILL_OVER_SMALL_SHARE * LOCAL_SMALL_SHARDS * num_nodes // width
    rows = [
        {
            "cluster": name,
            "hit_ratio": _local_fill(root / name.split()[0], limits, fill, block_bytes),
        }
        for name, limits in (("equal nodes, same total", equal), ("small nodes, weighted", hetero))
    ]
    for row in rows:
        row["points_vs_equal"] = round(100 * (row["hit_ratio"] - rows[0]["hit_ratio"]), 2)
    return {"nodes": num_nodes, "small_nodes": num_small, "fill_blocks": fill, "rows": rows}


def _local_fill(root: Path, limits: list[int], fill: int, block_bytes: int) -> float:
    """Start a local cluster with these byte limits, put ``fill`` blocks, read them all."""
    root.mkdir(parents=True, exist_ok=True)
    config = local_config(root, len(limits), fsync=False, scrub_bytes_per_s=0)
    nodes = tuple(
        dataclasses.replace(n, max_bytes=b) for n, b in zip(config.nodes, limits, strict=True)
    )
    pairs = [(n.id, n.failure_domain) for n in nodes]
    groups = make_groups(pairs, config.codec.num_shards, None, node_weights(nodes))
    config = dataclasses.replace(config, nodes=nodes, groups=tuple(groups))
    with LocalCluster._spawn_all(root, config, False, STARTUP_TIMEOUT_S) as cluster:
        return asyncio.run(_fill_and_read(cluster.cluster_toml, fill, block_bytes))


async def _fill_and_read(cluster_toml: Path, fill: int, block_bytes: int) -> float:
    keys = [i.to_bytes(16, "big") for i in range(fill)]
    block = bytes(np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8))
    async with KVClient.connect(cluster_toml, tenant="bench") as kv:
        for start in range(0, fill, LOCAL_BATCH):
            batch = keys[start : start + LOCAL_BATCH]
            await kv.put_batch(batch, [block] * len(batch), traffic_class="chat")
        found = 0
        for start in range(0, fill, LOCAL_BATCH):
            found += sum(await kv.contains(keys[start : start + LOCAL_BATCH]))
    return round(found / fill, 4)
