"""Shared by the tests on secured clusters: tenants with tokens, and incompressible blocks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from client import KVClient
from deploy.local_cluster import LocalCluster


async def wait_for_token(cluster: LocalCluster, tenant: str, token: str) -> None:
    """Return once every node accepts ``token``."""
    async with KVClient.connect(cluster.cluster_toml, tenant=tenant, token=token) as kv:
        await kv.wait_until_accepted()


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
