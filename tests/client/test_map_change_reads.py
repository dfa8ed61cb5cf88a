"""During a map change reads consult the old placement for what the new one misses; writes go
to the new one (client/kv_client.py, kvstore/map_changes.py). A static 16-node cluster: the
client is handed the maps directly, so this needs no etcd."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from deploy.local_nodes import spawn_node, wait_healthy
from kvstore.config import ClusterConfig, save_cluster

pytestmark = pytest.mark.timeout(300)


def _three_slots_moved(config: ClusterConfig) -> ClusterConfig:
    """Every group's first three slots given to nodes outside it (which hold nothing of it):
    the new placement alone has 9 of a block's shards, fewer than k = 10."""
    all_ids = [n.id for n in config.nodes]
    groups = []
    for group in config.groups:
        outside = [n for n in all_ids if n not in group]
        groups.append((*outside[:3], *group[3:]))
    return dataclasses.replace(
        config, epoch=config.epoch + 1, groups=tuple(groups), moving_from=config.groups
    )


def test_reads_fall_back_to_the_old_placement_and_writes_use_the_new(tmp_path: Path) -> None:
    with LocalCluster.start(tmp_path / "c", 16, fsync=False, repair_bytes_per_s=0) as cluster:
        asyncio.run(_scenario(cluster))


async def _scenario(cluster: LocalCluster) -> None:
    rng = random.Random(15)
    keys = block_keys(list(range(20 * 4)), 4, "moves", "salt")
    blocks = {key: rng.randbytes(rng.randint(1000, 20_000)) for key in keys}
    async with KVClient.connect(cluster.config, "acme") as old:
        for key, block in blocks.items():
            await old.put(key, block)
    cluster_before = cluster.config
    moving = _three_slots_moved(cluster.config)
    settled = dataclasses.replace(moving, moving_from=())
    async with KVClient.connect(settled, "acme") as new_only:
        got = await new_only.get_batch(keys)
        assert all(g is None for g in got), (
            "9 shards in the new placement must not decode (the test's premise)"
        )
    async with KVClient.connect(moving, "acme") as kv:
        got = await kv.get_batch(keys)
        assert got == [blocks[k] for k in keys], "reads during a move must consult the old map"
        assert await kv.contains(keys) == [True] * len(keys), "contains must ask both maps"
    # The nodes follow the new map too (etcd does this without restarts; here a restart):
    # a write during the move lands in the new placement only.
    await asyncio.to_thread(_restart_all, cluster, moving)
    fresh = block_keys(list(range(4)), 4, "moves-new", "salt")[0]
    async with KVClient.connect(moving, "acme") as kv:
        await kv.put(fresh, b"new placement" * 100)
    async with KVClient.connect(settled, "acme") as new_only:
        assert await new_only.get(fresh) == b"new placement" * 100, "writes go to the new map"
    async with KVClient.connect(moving, "acme") as kv:
        await kv.delete(keys[:5])
    async with KVClient.connect(cluster_before, "acme") as old:
        got = await old.get_batch(keys[:6])
        assert got[:5] == [None] * 5, "a delete during a move must reach the old placement too"
        assert got[5] == blocks[keys[5]]


def _restart_all(cluster: LocalCluster, config: ClusterConfig) -> None:
    cluster.stop()
    cluster.config = config
    save_cluster(config, cluster.cluster_toml)
    for node in config.nodes:
        cluster.procs[node.id] = spawn_node(cluster.root, node.id)
    wait_healthy(cluster.root, config, cluster.procs)
