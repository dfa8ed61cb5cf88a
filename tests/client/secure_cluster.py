"""Shared by the tests on secured clusters: tenants with tokens, and incompressible blocks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from client import KVClient
from deploy.local_cluster import LocalCluster
from kvstore.errors import PermissionDenied
from kvstore.proto import kvstore_pb2 as pb

RELOAD_TIMEOUT_S = 30.0


async def wait_for_token(cluster: LocalCluster, tenant: str, token: str) -> None:
    """Return once every node accepts ``token``. Nodes re-read the credentials file within a
    second of a change when idle, later under load; ``contains`` alone returns once k nodes
    answered, and a put needs 11, so each node is asked."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + RELOAD_TIMEOUT_S
    async with KVClient.connect(cluster.cluster_toml, tenant=tenant, token=token) as kv:
        request = pb.ContainsRequest(tenant=tenant, keys=[bytes(16)])
        while loop.time() < deadline_s:
            calls = (conn.call("Contains", request, 5.0) for conn in kv.conns.values())
            replies = await asyncio.gather(*calls, return_exceptions=True)
            if not any(isinstance(reply, PermissionDenied) for reply in replies):
                return
            await asyncio.sleep(0.1)
    raise AssertionError("nodes never accepted a token added to the credentials file")


def add_tenants(cluster: LocalCluster, names: Sequence[str]) -> dict[str, str]:
    """Tenant name -> its new token, once every node accepts it."""
    tokens = {name: cluster.add_tenant(name) for name in names}

    async def wait_all() -> None:
        await asyncio.gather(*(wait_for_token(cluster, n, t) for n, t in tokens.items()))

    asyncio.run(wait_all())
    return tokens


def random_block(seed: int, num_bytes: int) -> bytes:
    """Seeded random bytes: every window of them is unique, so a scan can look for them."""
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
