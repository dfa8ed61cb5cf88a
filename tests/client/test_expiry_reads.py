"""Reads of blocks whose segments expiry frees, over each transport: a clean miss, never stale
bytes (tests/kvstore/store/test_read_batch.py frees a segment in the middle of a node's read)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from kvstore.wire.ucx_worker import ucx_available

pytestmark = pytest.mark.timeout(120)

TIME_SCALE = 2 * 86_400.0  # 2 virtual days per real second: agent blocks live 1.5 s


@pytest.mark.parametrize(
    "transport",
    [
        "grpc",
        pytest.param(
            "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
        ),
        "local",
    ],
)
async def test_expired_blocks_read_as_clean_misses(tmp_path: Path, transport: str) -> None:
    rng = random.Random(5)
    keys = block_keys(list(range(8 * 4)), 4, "expiry", "salt")
    blocks = {key: rng.randbytes(rng.choice([300_000, 4 << 20])) for key in keys}
    with LocalCluster.start(tmp_path, 12, TIME_SCALE, fsync=False) as cluster:
        async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
            await kv.put_batch(list(blocks), list(blocks.values()), traffic_class="agent")
            outs = [bytearray(len(block)) for block in blocks.values()]
            assert all(await kv.get_batch_into(list(blocks), outs)), "fresh blocks not read"
            assert [bytes(o) for o in outs] == list(blocks.values()), "fresh blocks read wrong"
            await asyncio.sleep(3.0)  # 6 virtual days: past the agent TTL, segments freed
            outs = [bytearray(len(block)) for block in blocks.values()]
            assert not any(await kv.get_batch_into(list(blocks), outs)), "expired block served"
            assert await kv.get_batch(list(blocks)) == [None] * len(blocks), "expired served"
            for key, block in blocks.items():
                out = bytearray(len(block))
                assert not await kv.get_into(key, out), f"an expired block was served ({transport})"
                assert await kv.get(key) is None, f"an expired block was served ({transport})"
            if transport == "ucx":
                assert kv.ucx is not None
                counters = kv.ucx.counters
                assert counters.num_ucx_replies > 0 and counters.num_fallbacks == 0, counters
            if transport == "local":
                assert kv.local is not None
                local = kv.local.counters
                assert local.num_local_replies > 0 and local.num_fallbacks == 0, local
            stats = [s for s in (await kv.node_stats()).values() if s is not None]
    num_expired = sum(c.expired for s in stats for c in s.classes if c.traffic_class == "agent")
    assert num_expired >= len(blocks), "the nodes did not expire the agent blocks"
