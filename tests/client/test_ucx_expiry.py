"""Reads over UCX of blocks whose segments expiry frees: a clean miss, never stale bytes."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from kvstore.ucx_worker import ucx_available

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not ucx_available(), reason="ucxx not installed"),
]

TIME_SCALE = 2 * 86_400.0  # 2 virtual days per real second: agent blocks live 1.5 s


async def test_expired_blocks_read_over_ucx_as_clean_misses(tmp_path: Path) -> None:
    rng = random.Random(5)
    keys = block_keys(list(range(8 * 4)), 4, "ucx-expiry", "salt")
    blocks = {key: rng.randbytes(rng.choice([300_000, 4 << 20])) for key in keys}
    with LocalCluster.start(tmp_path, 12, TIME_SCALE, fsync=False) as cluster:
        async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport="ucx") as kv:
            await asyncio.gather(*(kv.put(k, b, traffic_class="agent") for k, b in blocks.items()))
            for key, block in blocks.items():
                out = bytearray(len(block))
                assert await kv.get_into(key, out) and out == block, "fresh block not read"
            await asyncio.sleep(3.0)  # 6 virtual days: past the agent TTL, segments freed
            for key, block in blocks.items():
                out = bytearray(len(block))
                assert not await kv.get_into(key, out), "an expired block was served over UCX"
                assert await kv.get(key) is None, "an expired block was served over UCX"
            assert kv.ucx is not None
            counters = kv.ucx.counters
            assert counters.num_ucx_replies > 0 and counters.num_fallbacks == 0, counters
            stats = [s for s in (await kv.node_stats()).values() if s is not None]
    num_expired = sum(c.expired for s in stats for c in s.classes if c.traffic_class == "agent")
    assert num_expired >= len(blocks), "the nodes did not expire the agent blocks"
