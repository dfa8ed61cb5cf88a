"""0 forged reads, on a real 12-node cluster with tokens, mutual TLS, end-to-end integrity
(client/integrity.py) and one sealed tenant (client/sealer.py).

The issue's three attacks, each against an unsealed tenant (keyed versions) and a sealed one
(GCM): the audit's node-token repair put, a planted key, and nodes whose stores were written
directly with shards of the attacker's choosing (every node of the group: an operator with
disk access to all of them, the worst case). Each must read as a miss for the tenant, never
as the attacker's bytes; the tenants' own blocks stay readable where nothing replaced them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from client import KVClient
from deploy.local_cluster import LocalCluster
from deploy.local_nodes import spawn_node, wait_healthy
from deploy.local_secrets import TLS_DIR
from erasure.codec import make_codec
from kvstore.certs import issue_files
from kvstore.node.store_holder import open_store
from kvstore.placement import Placement
from kvstore.store.shard_store import PutOptions
from tests.client.secure_cluster import random_block
from tests.client.test_node_trust import _forged_repair_puts
from ttl.clock import make_clock

pytestmark = pytest.mark.timeout(900)
STARTUP_TIMEOUT_S = 300  # twelve TLS nodes on a loaded 2-core machine
TENANTS = ("acme", "vault")  # acme: keyed versions; vault: sealed (AES-GCM)
WRITTEN, PLANTED, OVERWRITTEN = b"w" * 16, b"p" * 16, b"o" * 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("forged")
    with LocalCluster.start(
        root,
        12,
        fsync=False,
        auth=True,
        mtls=True,
        encrypt=["vault"],
        startup_timeout_s=STARTUP_TIMEOUT_S,
    ) as c:
        yield c


def _client(cluster: LocalCluster, tenant: str, token: str) -> KVClient:
    cert, key = issue_files(cluster.root / TLS_DIR, f"{tenant}-client")
    return KVClient.connect(
        cluster.cluster_toml,
        tenant=tenant,
        token=token,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
    )


def _write_stores_directly(cluster: LocalCluster, writes: list[tuple[str, bytes, bytes]]) -> None:
    """Each (tenant, key, block): every node of the key's group stopped, its store given the
    shard of ``block`` (an xxh3 version, newer than anything there), then started again."""
    config = cluster.config
    codec = make_codec(config.codec)
    placement = Placement(config)
    clock = make_clock(config.ttl.time_scale, config.ttl.origin_unix_s)
    stopped = sorted({n for _, key, _ in writes for n in placement.nodes_for_key(key)})
    for node_id in stopped:
        cluster.kill_node(node_id)
    for tenant, key, block in writes:
        shards = codec.encode(block)
        for index, node_id in enumerate(placement.nodes_for_key(key)):
            store = open_store(config, config.node(node_id), clock)
            try:
                options = PutOptions(written_at_s=[clock.now() + 60])
                stored = store.put(tenant, "chat", [(key, shards[index])], options)
                assert stored.num_stored == 1, f"the direct write to {node_id} did not land"
            finally:
                store.close()
    for node_id in stopped:
        cluster.procs[node_id] = spawn_node(cluster.root, node_id)
    restarted = {n: cluster.procs[n] for n in stopped}
    wait_healthy(cluster.root, config, restarted, timeout_s=STARTUP_TIMEOUT_S)


async def _tokens(cluster: LocalCluster) -> dict[str, str]:
    tokens = {tenant: cluster.add_tenant(tenant) for tenant in TENANTS}
    for tenant, token in tokens.items():
        async with _client(cluster, tenant, token) as kv:
            await kv.wait_until_accepted()
    return tokens


async def test_no_forged_block_reads_as_bytes(cluster: LocalCluster) -> None:
    tokens = await _tokens(cluster)
    genuine = {tenant: random_block(i, 300_000) for i, tenant in enumerate(TENANTS)}
    for tenant, token in tokens.items():
        async with _client(cluster, tenant, token) as kv:
            await kv.put(WRITTEN, genuine[tenant])
            await kv.put(OVERWRITTEN, genuine[tenant])
            assert await kv.get(WRITTEN) == genuine[tenant], f"{tenant}: own block unreadable"
    forged = random_block(999, 300_000)
    forged_reads: list[str] = []
    for tenant in TENANTS:
        for key in (WRITTEN, PLANTED):  # the audit's node-token repair put (refused)
            codes = await asyncio.to_thread(_forged_repair_puts, cluster, key, forged, tenant)
            assert not any(c.startswith("OK") for c in codes.values()), codes
    # Stores written directly, every node of the group, each tenant's two keys.
    writes = [(t, key, forged) for t in TENANTS for key in (OVERWRITTEN, PLANTED)]
    await asyncio.to_thread(_write_stores_directly, cluster, writes)
    for tenant, token in tokens.items():
        async with _client(cluster, tenant, token) as kv:
            for key in (WRITTEN, PLANTED, OVERWRITTEN):
                got = await kv.get(key)
                if got == forged:
                    forged_reads.append(f"{tenant} {key!r}")
                if key in (PLANTED, OVERWRITTEN):
                    assert got is None, f"{tenant} {key!r}: not a miss ({len(got or b'')} B)"
            assert await kv.get(WRITTEN) == genuine[tenant], f"{tenant}: own block lost"
    assert not forged_reads, f"forged bytes read as the tenant's: {forged_reads}"
