"""Membership on a real etcd: a 12-node local cluster joins, drains, removes and replaces
nodes while a client keeps reading, without restarts, losing nothing.

Needs the ``etcd`` binary (Debian's etcd-server, installed by ``make system-packages``); skips
with that advice without it. Every node and etcd is started on 127.0.0.1 and stopped on exit.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from kvstore.config import ClusterConfig
from kvstore.map_changes import changed_slots, drain
from kvstore.tls import sync_channel
from tests.deploy.etcd_marks import needs_etcd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    needs_etcd,
]

KiB, MiB = 1 << 10, 1 << 20
SERVING = health_pb2.HealthCheckResponse.SERVING
REPAIR = {"repair_bytes_per_s": 256 * MiB, "repair_scan_interval_s": 600.0}
MOVE_TIMEOUT_S = 300.0


def _blocks(num: int) -> dict[bytes, bytes]:
    rng = random.Random(15)
    keys = block_keys(list(range(num * 4)), 4, "membership", "salt")
    return {key: rng.randbytes(rng.randint(1 * KiB, 32 * KiB)) for key in keys}


async def _check_all(kv: KVClient, blocks: dict[bytes, bytes]) -> int:
    """Blocks that did not read back; a wrong byte fails at once."""
    num_lost = 0
    keys = list(blocks)
    for start in range(0, len(keys), 16):
        batch = keys[start : start + 16]
        for key, got in zip(batch, await kv.get_batch(batch), strict=True):
            assert got is None or got == blocks[key], "a read returned WRONG BYTES"
            num_lost += got is None
    return num_lost


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.2)


def _health_v1(address: str) -> int:
    with sync_channel(address, None) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_join_drain_remove_and_down_out_lose_nothing(tmp_path: Path) -> None:
    with LocalCluster.start(
        tmp_path / "c", 12, fsync=False, etcd="local", down_out_s=8.0, **REPAIR
    ) as cluster:
        deadline_s = time.monotonic() + 30
        while _health_v1(cluster.config.nodes[0].address) != SERVING:
            assert time.monotonic() < deadline_s, "grpc.health.v1 never said SERVING"
            time.sleep(0.1)
        figures = asyncio.run(_scenario(cluster))
    print(json.dumps(figures, indent=1))


async def _scenario(cluster: LocalCluster) -> list[dict[str, object]]:
    blocks = _blocks(40)
    figures: list[dict[str, object]] = []
    async with KVClient.connect(cluster.cluster_toml, "acme") as kv:
        for key, block in blocks.items():
            await kv.put(key, block)

        async def change(
            name: str, act: Callable[[], object], done: Callable[[ClusterConfig], bool]
        ) -> None:
            before = await asyncio.to_thread(cluster.current_map)
            started_s = time.monotonic()
            await asyncio.to_thread(act)
            after = await asyncio.to_thread(cluster.wait_for_map, done, MOVE_TIMEOUT_S, name)
            converge_s = time.monotonic() - started_s
            await _until(
                lambda: kv.config.epoch >= after.epoch,
                60,
                f"{name}: the client did not follow map epoch {after.epoch} (bug in the watch)",
            )
            num_lost = await _check_all(kv, blocks)
            assert num_lost == 0, f"{name}: {num_lost} blocks lost"
            moved = changed_slots(before.groups, after.groups)
            figures.append(
                {"change": name, "epoch": after.epoch, "slots_moved": len(moved),
                 "converge_s": round(converge_s, 1), "blocks_lost": num_lost}
            )  # fmt: skip

        not_moving = lambda c: not c.moving_from  # noqa: E731
        await change("join n12", lambda: cluster.join_node("n12"), not_moving)
        stats = await kv.node_stats()
        assert stats["n12"] is not None and stats["n12"].shards > 0, "repair did not fill n12"
        assert stats["n12"].epoch == kv.config.epoch, "the new node does not follow the map"

        await change(
            "drain n03",
            lambda: cluster.change_map(lambda c: drain(c, "n03")),
            lambda c: c.node("n03").state == "left",
        )
        await asyncio.to_thread(cluster.remove_node, "n03")
        assert await _check_all(kv, blocks) == 0, "blocks lost once the drained node stopped"

        await change("join n13", lambda: cluster.join_node("n13"), not_moving)
        cluster.kill_node("n05")
        await change("n05 down -> out", lambda: None, lambda c: c.node("n05").state == "left")
        stats = await kv.node_stats()
        epochs = {n: s.epoch for n, s in stats.items() if s is not None}
        assert set(epochs.values()) == {kv.config.epoch}, f"nodes on other epochs: {epochs}"
    return figures
