"""etcd with TLS, client certificates and RBAC (deploy/local_etcd.py, kvstore/membership.py),
against a real etcd: the writers' certificate changes the map and registers, the readers'
only reads it, and no other client (plaintext, no certificate, another CA's) gets in."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from client import KVClient
from deploy.local_cluster import LocalCluster, etcd_call, local_config
from deploy.local_etcd import issue_etcd_certs, membership_tls, start_etcd, stop_etcd
from deploy.local_nodes import free_ports
from kvstore.certs import init_ca, issue_files
from kvstore.config import MembershipConfig
from kvstore.errors import Unavailable
from kvstore.membership import EtcdMembership
from tests.deploy.etcd_marks import needs_etcd

pytestmark = [needs_etcd, pytest.mark.timeout(300)]


def test_tls_etcd_lets_in_its_writers_and_readers_only(tmp_path: Path) -> None:
    tls = issue_etcd_certs(tmp_path / "etcd-tls")
    endpoint = start_etcd(tmp_path, *free_ports(2), tls=tls)
    try:
        writer = MembershipConfig(etcd=endpoint, lease_ttl_s=2, **membership_tls(tls))
        cfg = dataclasses.replace(local_config(tmp_path, 12), membership=writer)
        asyncio.run(_writers_and_readers(cfg))
        init_ca(tmp_path / "kvstore-ca")  # a tenant's certificate of the cluster's CA
        tenant_cert, tenant_key = issue_files(tmp_path / "kvstore-ca", "acme")
        strangers = {
            "plaintext": MembershipConfig(etcd=endpoint),
            "no certificate": MembershipConfig(etcd=endpoint, ca_file=str(tls.ca_file)),
            "another CA's certificate": MembershipConfig(
                etcd=endpoint,
                ca_file=str(tls.ca_file),
                cert_file=str(tenant_cert),
                key_file=str(tenant_key),
            ),
        }
        for what, membership in strangers.items():
            with pytest.raises(Unavailable):
                asyncio.run(_read_map(membership))
                pytest.fail(f"etcd answered a client with {what}")
    finally:
        stop_etcd(tmp_path)


async def _writers_and_readers(cfg) -> None:
    async with EtcdMembership(cfg.membership) as etcd:
        assert (await etcd.create_map(cfg)).epoch == 1
        register = asyncio.create_task(etcd.keep_registered("n00", {"address": "a"}))
        try:
            for _ in range(100):
                if "n00" in await etcd.live_members():
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("a node could not register under a lease over TLS")
        finally:
            register.cancel()
            await asyncio.gather(register, return_exceptions=True)
    async with EtcdMembership(cfg.membership, reader=True) as reader:
        got = await reader.get_map()
        assert got is not None and got[0].epoch == 1, "the reader could not read the map"
        with pytest.raises(Unavailable):
            await reader.change_map(lambda c: dataclasses.replace(c, epoch=c.epoch + 1))
            pytest.fail("etcd let the readers' certificate change the map")


async def _read_map(membership: MembershipConfig) -> None:
    async with EtcdMembership(membership) as etcd:
        await etcd.get_map()


def test_a_tls_cluster_runs_its_etcd_over_tls(tmp_path: Path) -> None:
    with LocalCluster.start(tmp_path, 12, fsync=False, tls=True, etcd="local") as cluster:
        membership = cluster.config.membership
        assert membership.ca_file and membership.cert_file, "the map's etcd has no TLS"
        deadline_s = time.monotonic() + 60  # nodes register once they serve
        while len(members := etcd_call(cluster.config, lambda m: m.live_members())) < 12:
            assert time.monotonic() < deadline_s, f"not all registered over TLS: {sorted(members)}"
            time.sleep(0.2)
        asyncio.run(_roundtrip(cluster))


async def _roundtrip(cluster: LocalCluster) -> None:
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
        await kv.put(b"e" * 16, b"over a TLS etcd")
        assert await kv.get(b"e" * 16) == b"over a TLS etcd"
