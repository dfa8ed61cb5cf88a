"""kvstore/membership.py against a real etcd (one member on 127.0.0.1): the map's
compare-and-swap, the watch, leases, and an endpoint list whose first member is down."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from pathlib import Path

import pytest

from deploy import local_cluster
from deploy.local_cluster import LocalCluster, local_config
from deploy.local_etcd import start_etcd, stop_etcd
from deploy.local_nodes import free_ports
from kvstore.config import ClusterConfig, MembershipConfig
from kvstore.errors import InvalidArgument
from kvstore.map_changes import drain, readdress
from kvstore.membership import EtcdMembership
from tests.deploy.etcd_marks import needs_etcd

pytestmark = [needs_etcd, pytest.mark.timeout(120)]


def test_map_cas_watch_leases_and_a_dead_first_endpoint(tmp_path: Path) -> None:
    dead_port, client_port, peer_port = free_ports(3)
    endpoint = start_etcd(tmp_path, client_port, peer_port)
    try:
        membership = MembershipConfig(etcd=f"127.0.0.1:{dead_port},{endpoint}", lease_ttl_s=2)
        cfg = dataclasses.replace(local_config(tmp_path, 13), membership=membership)
        asyncio.run(_scenario(cfg))
        with pytest.raises(InvalidArgument, match="already holds a cluster map"):
            LocalCluster.start(tmp_path / "second", 12, etcd=endpoint)
        assert not (tmp_path / "second" / "pids.json").exists(), "no node may have started"
    finally:
        stop_etcd(tmp_path)


async def _scenario(cfg: ClusterConfig) -> None:
    async with EtcdMembership(cfg.membership) as etcd:
        assert (await etcd.create_map(cfg)).epoch == 1, "the first endpoint is down: use the next"
        again = dataclasses.replace(cfg, epoch=7)
        assert (await etcd.create_map(again)).epoch == 1, "create_map must not overwrite a map"
        seen: list[int] = []

        async def watch() -> None:
            async for new in etcd.watch_map():
                seen.append(new.epoch)

        watcher = asyncio.create_task(watch())
        # Concurrent changes: each compare-and-swap loser reads again and applies its change.
        ports = free_ports(4)
        changes = [
            etcd.change_map(lambda c, i=i: readdress(c, f"n0{i}", f"127.0.0.1:{ports[i]}", 0))
            for i in range(4)
        ]
        await asyncio.gather(*changes)
        got = await etcd.get_map()
        assert got is not None and got[0].epoch == 5, "a change was lost or applied twice"
        assert [got[0].node(f"n0{i}").address for i in range(4)] == [
            f"127.0.0.1:{p}" for p in ports
        ]
        await etcd.change_map(lambda c: drain(c, "n05"))
        with pytest.raises(InvalidArgument, match="still moving"):
            await etcd.change_map(lambda c: drain(c, "n06"))
        deadline = asyncio.get_running_loop().time() + 30
        while seen[-1:] != [6]:
            assert asyncio.get_running_loop().time() < deadline, f"the watch saw only {seen}"
            await asyncio.sleep(0.05)
        assert seen == sorted(seen) and seen[0] == 1, f"epochs out of order: {seen}"

        registered = asyncio.create_task(etcd.keep_registered("n00", {"pid": 1}))
        while "n00" not in await etcd.live_members():
            await asyncio.sleep(0.05)
        await asyncio.sleep(3)  # longer than the 2 s TTL: the keep-alive must hold it
        assert "n00" in await etcd.live_members(), "the lease was not kept alive"
        registered.cancel()
        await asyncio.gather(registered, return_exceptions=True)
        assert "n00" not in await etcd.live_members(), "a stopped node's lease is revoked"
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


def test_a_port_taken_at_start_moves_the_map_in_etcd_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free ports are only free when chosen. When one is taken before its node binds it, the
    start picks new ports; with etcd the nodes that came up have stored (and cached) the map
    of the old ports, and a node follows that map, not the file: the move must reach etcd."""
    holder = socket.socket()
    taken: list[str] = []

    def config_with_a_taken_port(*args: object, **kwargs: object) -> ClusterConfig:
        cfg = local_config(*args, **kwargs)  # type: ignore[arg-type]
        host, port = cfg.nodes[0].address.rsplit(":", 1)
        holder.bind((host, int(port)))
        holder.listen()
        taken.append(cfg.nodes[0].address)
        return cfg

    monkeypatch.setattr(local_cluster, "local_config", config_with_a_taken_port)
    with holder, LocalCluster.start(tmp_path, 12, fsync=False, etcd="local") as cluster:
        assert cluster.config.node("n00").address != taken[0], "n00 kept the taken port"
        in_etcd = cluster.current_map()
        assert in_etcd.epoch == 2, "the move is a map change in etcd"
        assert [n.address for n in in_etcd.nodes] == [n.address for n in cluster.config.nodes]
