"""Shared by the tests on secured clusters: tenants with tokens, and incompressible blocks."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from deploy.local_cluster import LocalCluster
from kvstore.auth import RELOAD_CHECK_S


def add_tenants(cluster: LocalCluster, names: Sequence[str]) -> dict[str, str]:
    """Tenant name -> its new token, once the nodes can have re-read the credentials file."""
    tokens = {name: cluster.add_tenant(name) for name in names}
    time.sleep(RELOAD_CHECK_S + 0.2)
    return tokens


def random_block(seed: int, num_bytes: int) -> bytes:
    """Seeded random bytes: every window of them is unique, so a scan can look for them."""
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
