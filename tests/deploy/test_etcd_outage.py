"""etcd is not needed to start (issue #25): with etcd stopped, a new client connects from the
map cached beside cluster.toml and marks it stale, a node restarts on it, ``cluster status``
lists every node and says etcd is unreachable, running clients log the outage once; when etcd
is back the client's map is fresh again.

Needs the ``etcd`` binary (Debian's etcd-server); skips with that advice without it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from deploy.local_etcd import etcd_pid, start_etcd, stop_etcd
from kvstore.map_cache import cache_path
from tests.deploy.etcd_marks import needs_etcd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), needs_etcd]

STATUS_WITHIN_S = 10.0


def _etcd_ports(root: Path) -> tuple[int, int]:
    """(client port, peer port) of the cluster's running local etcd, from its command line."""
    pid = etcd_pid(root)
    assert pid is not None, "the local etcd is not running"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    client = argv[argv.index("--listen-client-urls") + 1]
    peer = argv[argv.index("--listen-peer-urls") + 1]
    return int(client.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])


def _status(root: Path) -> tuple[dict, float]:
    started_s = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "cluster", "status", "--dir", str(root), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    return json.loads(out.stdout), time.monotonic() - started_s


def test_clients_nodes_and_status_start_without_etcd(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "c"
    with LocalCluster.start(root, 12, fsync=False, etcd="local") as cluster:
        caplog.set_level(logging.WARNING, logger="kvstore.membership")
        asyncio.run(_outage(cluster))
    outage_lines = [r for r in caplog.records if "no etcd endpoint" in r.getMessage()]
    assert len(outage_lines) <= 2, (  # the running client's watch, and the fresh client's
        f"the outage was logged {len(outage_lines)} times: once per outage per client"
    )


async def _outage(cluster: LocalCluster) -> None:
    root = cluster.root
    blocks = {k: k * 64 for k in block_keys(list(range(4 * 20)), 4, "outage", "salt")}
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as running:
        for key, block in blocks.items():
            await running.put(key, block, timeout_s=60.0)
        assert cache_path(cluster.cluster_toml).exists(), "etcd's map was not cached"
        ports = _etcd_ports(root)
        stop_etcd(root)
        outage_s = time.monotonic()
        async with KVClient.connect(cluster.cluster_toml, tenant="acme") as fresh:
            assert fresh.map_stale, "a client on the cached map did not say it is stale"
            got = await fresh.get_batch(list(blocks), timeout_s=60.0)
            assert got == list(blocks.values()), "reads from the cached map failed"
            await fresh.put(b"w" * 16, b"written during the outage", timeout_s=60.0)
        cluster.restart_node("n04")  # a node starts on the cached map too
        status, status_s = _status(root)
        assert status["etcd_reachable"] is False and status["map_source"] == "cache"
        assert [(n["id"], n["up"]) for n in status["nodes"]] == [
            (f"n{i:02d}", True) for i in range(12)
        ], "cluster status did not list every node from the cached map"
        # Its own work (etcd, then one Stats per node); the interpreter's start-up on a loaded
        # machine is not status's (status_s, printed, has it).
        assert status["elapsed_s"] < STATUS_WITHIN_S, f"cluster status took {status_s:.1f} s"
        print(f"cluster status with etcd down: {status['elapsed_s']} s ({status_s:.1f} s total)")
        while not running.map_stale:  # the running client's watch notices the outage
            assert time.monotonic() - outage_s < 60, "a running client never saw etcd go"
            await asyncio.sleep(0.2)
        await asyncio.sleep(3.0)  # its watch retries every second: still logged once
        start_etcd(root, *ports)
        deadline_s = time.monotonic() + 60
        while running.map_stale:
            assert time.monotonic() < deadline_s, "the client never saw etcd back"
            await asyncio.sleep(0.2)
        assert running._map_follower.num_etcd_outages == 1
        assert await running.get(b"w" * 16, timeout_s=60.0) == b"written during the outage"
