"""Retention caps on a real node (a virtual day per second): a tenant's ``max_ttl_s`` in the
credentials file cuts its TTL below the class TTL, also for blocks stored before the cap, and
``cluster status`` reports the caps in force."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deploy.cluster_status import fetch_stats, retention_caps
from kvstore.auth import Role, add_principal, set_tenant_caps
from kvstore.config import load_cluster
from tests.kvstore.node_harness import DAY_S, NodeClient, make_shard, write_config
from ttl.clock import make_clock


async def test_caps_cut_ttls_and_show_in_status(tmp_path: Path, start_node) -> None:
    credentials = tmp_path / "credentials.toml"
    acme = add_principal(credentials, "acme", Role.TENANT)
    globex = add_principal(credentials, "globex", Role.TENANT)
    admin = add_principal(credentials, "admin", Role.ADMIN)
    set_tenant_caps(credentials, "acme", {"chat": 2 * DAY_S})
    config = write_config(tmp_path, time_scale=DAY_S, credentials_file=str(credentials))
    start_node(config)
    cluster = load_cluster(config)
    clock = make_clock(cluster.ttl.time_scale, cluster.ttl.origin_unix_s)
    address, key = cluster.nodes[0].address, b"r" * 16
    async with (
        NodeClient(address, "acme", acme) as acme_client,
        NodeClient(address, "globex", globex) as globex_client,
    ):
        t0 = clock.now()
        await acme_client.put([(key, make_shard(b"acme chat"))], traffic_class="chat")
        await globex_client.put([(key, make_shard(b"globex chat"))], traffic_class="chat")
        await asyncio.sleep(max(0.0, t0 + 1.4 * DAY_S - clock.now()) / DAY_S)
        acme_versions = await acme_client.contains([key])
        if clock.now() < t0 + 1.9 * DAY_S:  # else the machine was too busy to tell
            assert len(acme_versions[0]) == 1, "acme's block expired before its 2-day cap"
        await asyncio.sleep(max(0.0, t0 + 2.5 * DAY_S - clock.now()) / DAY_S)
        assert await acme_client.contains([key]) == [[]], "acme's block outlived its 2-day cap"
        assert len((await globex_client.contains([key]))[0]) == 1, "a cap hit another tenant"
        set_tenant_caps(credentials, "globex", {"chat": DAY_S})  # tightened while running
        # The file is re-read within a second and applied at a tick; later under load.
        for _ in range(150):
            if await globex_client.contains([key]) == [[]]:
                break
            await asyncio.sleep(0.1)
        assert await globex_client.contains([key]) == [[]], "a tightened cap spared old blocks"
    stats = await asyncio.to_thread(fetch_stats, cluster, admin)
    assert retention_caps(stats) == [
        {"tenant": "acme", "traffic_class": "chat", "max_ttl_s": 2 * DAY_S},
        {"tenant": "globex", "traffic_class": "chat", "max_ttl_s": DAY_S},
    ]
