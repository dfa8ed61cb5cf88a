"""Twelve hosts for real: each a network namespace with its own address (veth on a bridge),
one node per host, etcd in its own namespace, TLS on (the nodes are off loopback).

In that cluster: kill a host, partition one (its link down), bring both back, add a 13th
host, drain one. Goals: no block lost, no wrong byte, shards moved = the ideal, and every
change converging (map finished, the client on the new epoch) within the deadline. The
figures print as JSON (``pytest -s``); docs/multi-host.md quotes them.

Skips cleanly where namespaces cannot be made (not root, or a sandbox); everything it made
is torn down even when it fails (tests/deploy/netns_harness.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster, etcd_call
from deploy.local_etcd import etcd_binary, issue_etcd_certs, membership_tls, start_etcd
from deploy.local_nodes import spawn_node, wait_healthy
from erasure.config import CodecConfig
from kvstore.certs import init_ca, issue_files
from kvstore.config import (
    ClusterConfig,
    MembershipConfig,
    NodeConfig,
    TLSConfig,
    TTLConfig,
    save_cluster,
)
from kvstore.map_changes import (
    changed_slots,
    drain,
    held_shards,
    ideal_join_shards,
    join,
    shards_moved,
)
from kvstore.placement import make_groups
from tests.deploy.netns_harness import Hosts, netns_unavailable_reason

NUM_HOSTS = 12
GRPC_PORT, METRICS_PORT = 50100, 50200
ETCD_INDEX = 200
MOVE_TIMEOUT_S = 300.0
KiB, MiB = 1 << 10, 1 << 20

_reason = netns_unavailable_reason() or (None if etcd_binary() else "no etcd binary")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(_reason is not None, reason=f"many-host test skipped: {_reason}"),
]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts()
    try:
        made.create_bridge()
        yield made
    finally:
        left = made.destroy()
        assert not left, f"namespaces or links left behind: {left}"


def _node(hosts: Hosts, root: Path, index: int) -> NodeConfig:
    """Host ``index`` made, and its node's entry with a certificate for its address."""
    name = f"h{index:02d}"
    address = hosts.add(name, index)
    cert, key = issue_files(root / "tls", name, [address, "localhost"], node=True)
    return NodeConfig(
        id=name,
        address=f"{address}:{GRPC_PORT}",
        metrics_port=METRICS_PORT,
        failure_domain=name,
        data_dir=str(root / name),
        fsync=False,
        repair_bytes_per_s=256 * MiB,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
    )


def _start(hosts: Hosts, root: Path) -> LocalCluster:
    # Off loopback TLS is on by default: a development CA and one certificate per node.
    ca_file = init_ca(root / "tls")
    nodes = tuple(_node(hosts, root, i) for i in range(NUM_HOSTS))
    etcd_host = hosts.add("etcd", ETCD_INDEX)
    etcd_tls = issue_etcd_certs(root / "tls" / "etcd", etcd_host)  # a TLS cluster: TLS etcd
    endpoint = start_etcd(
        root, 2379, 2380, host=etcd_host, prefix=hosts.prefix("etcd"), tls=etcd_tls
    )
    codec = CodecConfig()
    config = ClusterConfig(
        epoch=1,
        nodes=nodes,
        groups=tuple(make_groups([(n.id, n.failure_domain) for n in nodes], codec.num_shards)),
        codec=codec,
        ttl=TTLConfig(origin_unix_s=time.time()),
        tls=TLSConfig("on", str(ca_file)),
        membership=MembershipConfig(etcd=endpoint, **membership_tls(etcd_tls)),
    )
    save_cluster(config, root / "cluster.toml")
    cluster = LocalCluster(root, config, spawn_prefix=hosts.prefix)
    try:
        for node in config.nodes:
            cluster.procs[node.id] = spawn_node(root, node.id, (), hosts.prefix(node.id))
        wait_healthy(root, config, cluster.procs, timeout_s=120)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _blocks(num: int) -> dict[bytes, bytes]:
    rng = random.Random(15)
    keys = block_keys(list(range(num * 4)), 4, "hosts", "salt")
    return {key: rng.randbytes(rng.randint(4 * KiB, 32 * KiB)) for key in keys}


async def _read_all(kv: KVClient, blocks: dict[bytes, bytes]) -> tuple[int, int]:
    """(blocks lost, blocks with wrong bytes)."""
    lost = wrong = 0
    keys = list(blocks)
    for start in range(0, len(keys), 16):
        batch = keys[start : start + 16]
        for key, got in zip(batch, await kv.get_batch(batch), strict=True):
            lost += got is None
            wrong += got is not None and got != blocks[key]
    return lost, wrong


async def _until(condition: Callable[[], Any], timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` (awaited if it returns a coroutine) is true."""
    started_s = time.monotonic()
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - started_s
        assert time.monotonic() - started_s < timeout_s, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.2)


def test_twelve_hosts_kill_partition_add_drain(hosts: Hosts, tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    root.mkdir()
    cluster = _start(hosts, root)
    try:
        report = asyncio.run(_scenario(cluster, hosts, root))
    finally:
        cluster.stop()
    print(json.dumps(report, indent=1))
    for step in report["steps"]:
        assert step["blocks_lost"] == 0, f"{step['step']}: blocks lost"
        assert step["wrong_bytes"] == 0, f"{step['step']}: WRONG BYTES returned"


async def _scenario(cluster: LocalCluster, hosts: Hosts, root: Path) -> dict[str, Any]:
    blocks = _blocks(60)
    key_array = np.frombuffer(b"".join(blocks), np.uint8).reshape(-1, 16)
    steps: list[dict[str, Any]] = []
    async with KVClient.connect(cluster.cluster_toml, "acme") as kv:
        for key, block in blocks.items():
            await kv.put(key, block)

        async def record(step: str, **figures: Any) -> None:
            lost, wrong = await _read_all(kv, blocks)
            steps.append({"step": step, "blocks_lost": lost, "wrong_bytes": wrong, **figures})

        await record("12 hosts up")
        await _host_faults(cluster, hosts, record)
        await _membership_changes(cluster, hosts, root, kv, key_array, record)
        stats = await kv.node_stats()
        on_epoch = {n: s.epoch for n, s in stats.items() if s is not None}
        assert set(on_epoch.values()) == {kv.config.epoch}, f"nodes on old epochs: {on_epoch}"
    return {"hosts": NUM_HOSTS + 1, "blocks": len(blocks), "steps": steps}


async def _host_faults(
    cluster: LocalCluster, hosts: Hosts, record: Callable[..., Awaitable[None]]
) -> None:
    """A host killed and restarted, then one partitioned from the others and healed."""

    def live() -> Any:
        return asyncio.to_thread(lambda: _live_members(cluster.config))

    cluster.kill_node("h04")
    await record("h04 killed")
    started_s = time.monotonic()
    await asyncio.to_thread(cluster.restart_node, "h04")
    await record("h04 back", converge_s=round(time.monotonic() - started_s, 1))

    hosts.set_link("h07", False)
    gone_s = await _until(
        lambda: _not_in(live(), "h07"), 60, "etcd noticed the partitioned host's lease"
    )
    await record("h07 partitioned", lease_expired_after_s=round(gone_s, 1))
    hosts.set_link("h07", True)
    back_s = await _until(lambda: _in(live(), "h07"), 60, "the healed host registered")
    await record("h07 link back", registered_again_after_s=round(back_s, 1))


async def _membership_changes(
    cluster: LocalCluster,
    hosts: Hosts,
    root: Path,
    kv: KVClient,
    key_array: np.ndarray,
    record: Callable[..., Awaitable[None]],
) -> None:
    """A 13th host joins, then h02 is drained and removed; shards moved against the ideal."""
    before = await asyncio.to_thread(cluster.current_map)
    new = dataclasses.replace(_node(hosts, root, 12), state="in")
    started_s = time.monotonic()
    await asyncio.to_thread(cluster.change_map, lambda c: join(c, new))
    cluster.procs["h12"] = spawn_node(root, "h12", (), hosts.prefix("h12"))
    after = await _settled(cluster, kv, lambda c: not c.moving_from)
    count = shards_moved(
        before, after, key_array, ideal_join_shards(len(key_array) * 12, len(after.nodes))
    )
    await record(
        "h12 joined (13th host)",
        converge_s=round(time.monotonic() - started_s, 1),
        slots_moved=len(changed_slots(before.groups, after.groups)),
        slots_ideal=sum(map(len, after.groups)) // len(after.nodes),
        shards_moved=count.moved_shards,
        shards_ideal=count.ideal_shards,
    )

    before = after
    started_s = time.monotonic()
    await asyncio.to_thread(cluster.change_map, lambda c: drain(c, "h02"))
    after = await _settled(cluster, kv, lambda c: c.node("h02").state == "left")
    count = shards_moved(before, after, key_array, held_shards(before, "h02", key_array))
    await record(
        "h02 drained",
        converge_s=round(time.monotonic() - started_s, 1),
        slots_moved=len(changed_slots(before.groups, after.groups)),
        shards_moved=count.moved_shards,
        shards_ideal=count.ideal_shards,
    )
    await asyncio.to_thread(cluster.remove_node, "h02")
    await record("h02 removed and stopped")


async def _settled(
    cluster: LocalCluster, kv: KVClient, done: Callable[[ClusterConfig], bool]
) -> ClusterConfig:
    after = await asyncio.to_thread(cluster.wait_for_map, done, MOVE_TIMEOUT_S, "the move")
    await _until(lambda: kv.config.epoch >= after.epoch, 60, "the client followed the map")
    return after


def _live_members(config: ClusterConfig) -> set[str]:
    return set(etcd_call(config, lambda m: m.live_members()))


async def _not_in(live: Any, node_id: str) -> bool:
    return node_id not in await live


async def _in(live: Any, node_id: str) -> bool:
    return node_id in await live
