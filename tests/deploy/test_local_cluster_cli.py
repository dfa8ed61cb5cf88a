"""`kvstore cluster up|status|down` as a user runs it: real processes, real ports."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.local_cluster import LocalCluster
from deploy.local_pids import is_node_process, read_pids, stop_pids
from kvstore.config import load_cluster
from kvstore.errors import Unavailable

pytestmark = pytest.mark.timeout(180)


def _kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvstore.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _wait_gone(node_to_pid: dict[str, int], timeout_s: float = 15.0) -> list[str]:
    deadline_s = time.monotonic() + timeout_s
    alive = list(node_to_pid)
    while alive and time.monotonic() < deadline_s:
        alive = [n for n in alive if is_node_process(node_to_pid[n], n)]
        time.sleep(0.05)
    return alive


def test_up_status_down(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    try:
        up = _kvstore(
            "cluster", "up", "--nodes", "12", "--dir", str(root), "--no-fsync",
            "--time-scale", "86400",
        )  # fmt: skip
        assert up.returncode == 0, f"cluster up failed:\n{up.stdout}\n{up.stderr}"
        node_to_pid = read_pids(root)
        assert sorted(node_to_pid) == [f"n{i:02d}" for i in range(12)]
        assert all(is_node_process(pid, n) for n, pid in node_to_pid.items()), "a node died"
        config = load_cluster(root / "cluster.toml")
        assert len(config.groups) == 12 and not config.nodes[0].fsync
        assert config.ttl.time_scale == 86400 and config.ttl.origin_unix_s > 0
        assert all(len({config.node(n).failure_domain for n in g}) == 12 for g in config.groups)

        status = _kvstore("cluster", "status", "--dir", str(root))
        assert status.returncode == 0, f"status says a node is down:\n{status.stdout}"
        assert "n11" in status.stdout and "chat" in status.stdout and "down" not in status.stdout

        down = _kvstore("cluster", "down", "--dir", str(root))
        assert down.returncode == 0, down.stderr
        assert _wait_gone(node_to_pid) == [], "cluster down left node processes running"
        assert json.loads((root / "pids.json").read_text()) == {}
        status = _kvstore("cluster", "status", "--dir", str(root))
        assert status.returncode == 1 and "down" in status.stdout
    finally:
        stop_pids(read_pids(root))


def test_too_few_nodes_and_missing_dir_are_clear_errors(tmp_path: Path) -> None:
    up = _kvstore("cluster", "up", "--nodes", "5", "--dir", str(tmp_path / "c"))
    assert up.returncode == 1 and "k+m = 12" in up.stderr, up.stderr
    status = _kvstore("cluster", "status", "--dir", str(tmp_path / "nowhere"))
    assert status.returncode == 1 and "cluster up" in status.stderr, status.stderr


def test_a_node_that_cannot_start_is_named_with_its_log(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(Unavailable, match=r"node n\d\d .*last lines of .*\.log") as info:
            LocalCluster.start(tmp_path, 12, base_port=port - 3, fsync=False)
    assert "bind" in str(info.value).lower() or "address" in str(info.value).lower()
    assert _wait_gone(read_pids(tmp_path)) == [], "a failed start must stop the nodes it started"


def test_up_with_auth_and_tls_add_tenant_status_and_caps(tmp_path: Path) -> None:
    """The contract: `cluster up --auth` writes an admin credential, `add-tenant` prints a
    tenant's new token, `cluster status` shows the retention caps."""
    root = tmp_path / "secure"
    try:
        up = _kvstore(
            "cluster", "up", "--nodes", "12", "--dir", str(root), "--no-fsync", "--auth", "--tls"
        )
        assert up.returncode == 0, f"cluster up --auth failed:\n{up.stdout}\n{up.stderr}"
        assert (root / "admin.token").stat().st_mode & 0o077 == 0, "admin token readable by all"
        config = load_cluster(root / "cluster.toml")
        assert config.tls_enabled and all(n.credentials_file for n in config.nodes)
        added = _kvstore(
            "cluster", "add-tenant", "--dir", str(root), "acme", "--max-ttl", "chat=1d"
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        token = added.stdout.strip()
        assert token.startswith("kvst_") and token not in (root / "credentials.toml").read_text()
        # Nodes re-read the credentials file within a second (later under load); the next
        # tick applies the caps.
        deadline_s = time.monotonic() + 30.0
        while True:
            status = _kvstore("cluster", "status", "--dir", str(root), "--json")
            assert status.returncode == 0, f"status with the admin token failed:\n{status.stderr}"
            document = json.loads(status.stdout)
            if document["retention_caps"] or time.monotonic() > deadline_s:
                break
            time.sleep(0.2)
        assert document["auth"] and document["tls"]
        assert document["retention_caps"] == [
            {"tenant": "acme", "traffic_class": "chat", "max_ttl_s": 86400.0}
        ]
        table = _kvstore("cluster", "status", "--dir", str(root))
        assert "retention caps" in table.stdout and "acme" in table.stdout, table.stdout
    finally:
        _kvstore("cluster", "down", "--dir", str(root))
        stop_pids(read_pids(root))


def test_base_port_places_etcd_and_joined_nodes_after_the_nodes(tmp_path: Path) -> None:
    """With --base-port nothing takes a free port: etcd and later nodes follow the range."""
    from dataclasses import replace

    from deploy.local_cluster import BASE_PORT_FILE, local_config, next_ports
    from kvstore.config import MembershipConfig

    config = local_config(tmp_path, 12, base_port=40_000)
    assert next_ports(tmp_path, config, 2) is None, "without --base-port: free ports"
    (tmp_path / BASE_PORT_FILE).write_text("40000")
    assert next_ports(tmp_path, config, 2) == [40_024, 40_025], "etcd: after 24 node ports"
    on_etcd = replace(config, membership=MembershipConfig(etcd="127.0.0.1:40024"))
    assert next_ports(tmp_path, on_etcd, 2) == [40_026, 40_027], "a joined node: after etcd"
    joined = replace(config.nodes[0], id="n12", address="127.0.0.1:40026", metrics_port=40_027)
    grown = replace(on_etcd, nodes=(*on_etcd.nodes, joined))
    assert next_ports(tmp_path, grown, 2) == [40_028, 40_029]
