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
  kvstore/placement_weights.py ``rebalance_slots``), as an existing cluster would be;
* small nodes, rebalanced, groups equal: the same slots with the groups left equal (the map
  records weights of 1): only the slots move (``kvstore bench map-moves``), and whole slots
  leave the small nodes a little over their weight;
* small nodes, cluster reweight (budget): the capacity-blind map moved by ``kvstore cluster
  reweight``'s default fit (kvstore/reweight.py): the slots the ideal pays for, the residual
  corrected within it.

Each row gives the hit ratio and its distance in points from the equal-nodes row, and the
fraction of the raw space placement lets the cluster fill before its first node evicts.

``--local DIR`` runs the fill on real local clusters instead (node processes, their byte
limits as ``max_bytes``, real eviction): equal nodes, then the small nodes as placement always
weighs them. After the fill the bench waits until the nodes' shard counts stop changing (an
eviction reaches the group's other members through their delete-log pulls), then the hit
ratio is the fraction of the blocks ``contains`` finds; the JSON also has each node's shards,
used bytes and limit, and the load average before each cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from client import KVClient
from deploy.local_cluster import LocalCluster, local_config, with_local_reserves
from erasure.config import CodecConfig
from kvstore.cli.args import size_arg
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.placement import groups_of_keys, make_groups
from kvstore.placement_weights import (
    group_weights,
    map_group_weights,
    node_weights,
    rebalance_slots,
    share_report,
)
from kvstore.reweight import reweight
from ttl.cluster_fill import fill_hit_ratio, usable_fraction

FILL_OVER_SMALL_SHARE = 3
SIM_SMALL_SHARDS = 2000  # without --local: a small node holds this many
LOCAL_SMALL_SHARDS = 300  # --local without --small-shards: a small node holds this many
LOCAL_STARTUP_TIMEOUT_S = 300.0  # 24 nodes starting on a loaded machine
SETTLE_POLL_S = 5.0  # longer than the repair probe's Health interval (delete-log pulls)
SETTLE_LIMIT_S = 120.0
LOCAL_SHARD_OVERHEAD_BYTES = 200  # shard and record headers, names (a margin)
LOCAL_BATCH = 16


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=24, help="nodes in the cluster")
    parser.add_argument("--small", type=int, default=4, help="nodes with half the space")
    parser.add_argument(
        "--small-shards",
        type=int,
        default=None,
        help=f"a small node's shards ({SIM_SMALL_SHARDS}; with --local {LOCAL_SMALL_SHARDS})",
    )
    parser.add_argument("--seed", type=int, default=3, help="seed of the keys")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument(
        "--local",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the fill on real local clusters under DIR instead (--block-bytes blocks)",
    )
    parser.add_argument(
        "--block-bytes", type=size_arg, default=64 << 10, help="with --local (units allowed)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.local is not None:
            small_shards = args.small_shards or LOCAL_SMALL_SHARDS
            result = measure_local(
                args.local, args.nodes, args.small, args.block_bytes, small_shards
            )
            print(json.dumps(result, indent=2))
            return _write(result, args.json)
        result = measure(args.nodes, args.small, args.small_shards or SIM_SMALL_SHARDS, args.seed)
    except ValueError as exc:
        print(f"kvstore bench capacity-fill: {exc}", file=sys.stderr)
        return 2
    print(f"fill: {result['fill_blocks']:,} blocks; cluster holds {result['cluster_blocks']:,}")
    print(f"{'cluster':<40} {'hit ratio':>9} {'vs equal':>9} {'usable':>7}")
    for row in result["rows"]:
        print(
            f"{row['cluster']:<40} {row['hit_ratio']:>9.4f} {row['points_vs_equal']:>+9.2f} "
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
        _row("small nodes, rebalanced, groups equal", _nodes(num_nodes, hetero), keys, "slots"),
        _row(
            "small nodes, cluster reweight (budget)", _nodes(num_nodes, hetero), keys, "reweighted"
        ),
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
    if how in ("rebalanced", "slots"):
        groups = rebalance_slots(groups, dict(pairs), weights)
    fitted = None if how in ("blind", "slots") else group_weights(groups, weights)
    if how == "reweighted":
        groups, fitted = _reweighted(nodes, groups)
    index = {n.id: i for i, n in enumerate(nodes)}
    members = [[index[n] for n in g] for g in groups]
    block_groups = groups_of_keys(keys, len(groups), fitted).tolist()
    hit_ratio = fill_hit_ratio([n.max_bytes for n in nodes], members, block_groups)
    shares = share_report(nodes, groups, fitted)
    usable = usable_fraction(
        {n.id: float(n.max_bytes) for n in nodes}, {n: s for n, (s, _) in shares.items()}
    )
    return {"cluster": name, "hit_ratio": round(hit_ratio, 4), "usable_fraction": round(usable, 4)}


def _reweighted(
    nodes: list[NodeConfig], groups: list[tuple[str, ...]]
) -> tuple[list[tuple[str, ...]], tuple[int, ...] | None]:
    """The capacity-blind map moved by ``kvstore cluster reweight``'s default fit."""
    unlimited = tuple(dataclasses.replace(n, max_bytes=0) for n in nodes)
    blind = ClusterConfig(epoch=1, nodes=unlimited, groups=tuple(groups))
    moved = reweight(blind, {n.id: n.max_bytes for n in nodes})
    return list(moved.groups), map_group_weights(moved)


def measure_local(
    root: Path, num_nodes: int, num_small: int, block_bytes: int, small_shards: int
) -> dict[str, Any]:
    """The same fill on real local clusters (one per row, started under ``root``): equal nodes,
    then nodes whose last ``num_small`` have half the byte limit (placement weighs them, as it
    always does). The limits make a small node hold ``small_shards`` shards."""
    width = CodecConfig().num_shards
    shard_bytes = -(-block_bytes // CodecConfig().k) + LOCAL_SHARD_OVERHEAD_BYTES
    small = small_shards * shard_bytes
    hetero = [2 * small] * (num_nodes - num_small) + [small] * num_small
    equal = [sum(hetero) // num_nodes] * num_nodes
    fill = FILL_OVER_SMALL_SHARE * small_shards * num_nodes // width
    rows = []
    for name, limits in (("equal nodes, same total", equal), ("small nodes, weighted", hetero)):
        load = os.getloadavg()[0]
        row = _local_fill(root / name.split()[0], limits, fill, block_bytes)
        rows.append({"cluster": name, **row, "load_average_before": load})
    for row in rows:
        row["points_vs_equal"] = round(100 * (row["hit_ratio"] - rows[0]["hit_ratio"]), 2)
    return {
        "nodes": num_nodes,
        "small_nodes": num_small,
        "small_node_shards": small_shards,
        "block_bytes": block_bytes,
        "fill_blocks": fill,
        "node_limits_bytes": {"equal": equal[0], "big": hetero[0], "small": small},
        "rows": rows,
        "load_average_after": os.getloadavg()[0],
    }


def _local_fill(root: Path, limits: list[int], fill: int, block_bytes: int) -> dict[str, Any]:
    """Start a local cluster with these byte limits, put ``fill`` blocks, let the evictions
    reach every member, read them all: the hit ratio and what each node holds."""
    root.mkdir(parents=True, exist_ok=True)
    config = local_config(root, len(limits), fsync=False, scrub_bytes_per_s=0)
    nodes = tuple(
        dataclasses.replace(n, max_bytes=b) for n, b in zip(config.nodes, limits, strict=True)
    )
    pairs = [(n.id, n.failure_domain) for n in nodes]
    groups = make_groups(pairs, config.codec.num_shards, None, node_weights(nodes))
    config = with_local_reserves(dataclasses.replace(config, nodes=nodes, groups=tuple(groups)))
    with LocalCluster._spawn_all(root, config, False, LOCAL_STARTUP_TIMEOUT_S) as cluster:
        return asyncio.run(_fill_and_read(cluster.cluster_toml, fill, block_bytes))


async def _fill_and_read(cluster_toml: Path, fill: int, block_bytes: int) -> dict[str, Any]:
    keys = [i.to_bytes(16, "big") for i in range(fill)]
    block = bytes(np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8))
    async with KVClient.connect(cluster_toml, tenant="bench") as kv:
        started_s = time.monotonic()
        for start in range(0, fill, LOCAL_BATCH):
            batch = keys[start : start + LOCAL_BATCH]
            await kv.put_batch(batch, [block] * len(batch), traffic_class="chat")
        fill_s = time.monotonic() - started_s
        stats = await _settled_stats(kv)
        found = 0
        for start in range(0, fill, LOCAL_BATCH):
            found += sum(await kv.contains(keys[start : start + LOCAL_BATCH]))
    held = {
        node_id: {"shards": s.shards, "used_bytes": s.used_bytes, "limit_bytes": s.capacity_bytes}
        for node_id, s in sorted(stats.items())
    }
    evicted = sum(s.evicted_blocks for s in stats.values())
    return {
        "hit_ratio": round(found / fill, 4),
        "fill_s": round(fill_s, 1),
        "evicted_blocks_counted": evicted,
        "nodes_after": held,
    }


async def _settled_stats(kv: KVClient) -> dict[str, Any]:
    """The nodes' Stats once their shard counts stopped changing: an eviction reaches the
    other members of its group through their delete-log pulls, seconds later; until then a
    block one member evicted still reads (11 shards of 12). Gives up after SETTLE_LIMIT_S."""
    previous: list[int] = []
    started_s = time.monotonic()
    while True:
        stats = await kv.node_stats(timeout_s=10.0)
        if any(s is None for s in stats.values()):
            raise RuntimeError("a node did not answer Stats after the fill")
        counts = [s.shards for _, s in sorted(stats.items())]
        if counts == previous or time.monotonic() - started_s > SETTLE_LIMIT_S:
            return stats
        previous = counts
        await asyncio.sleep(SETTLE_POLL_S)
