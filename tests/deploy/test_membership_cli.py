"""The membership commands as an operator types them: ``cluster up --etcd`` (a local etcd),
``join``, ``status --json``, ``drain``, ``remove``, ``down``, each a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.local_etcd import etcd_pid
from deploy.local_pids import is_node_process, read_pids
from tests.deploy.etcd_marks import needs_etcd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    needs_etcd,
]

REPO = Path(__file__).resolve().parents[2]


def _kvstore(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert not check or done.returncode == 0, f"kvstore {' '.join(args)}: {done.stderr}"
    return done


def _status(root: Path) -> dict[str, Any]:
    return json.loads(_kvstore("cluster", "status", "--dir", str(root), "--json").stdout)


def test_up_join_status_drain_remove_down(tmp_path: Path) -> None:
    root = tmp_path / "c"
    try:
        up = _kvstore("cluster", "up", "--nodes", "12", "--dir", str(root), "--etcd", "--no-fsync")
        assert "membership on etcd 127.0.0.1:" in up.stdout
        joined = _kvstore("cluster", "join", "--dir", str(root))
        assert "node n12 joined" in joined.stdout and "11 of 144 group slots move" in joined.stdout
        status = _status(root)
        assert status["membership"].startswith("127.0.0.1:") and status["epoch"] >= 2
        nodes = {n["id"]: n for n in status["nodes"]}
        assert len(nodes) == 13 and all(
            n["state"] == "in" and n["registered"] for n in nodes.values()
        )
        pids = read_pids(root)
        assert all(nodes[n]["pid"] == pid for n, pid in pids.items()), "pid not the node's own"
        (fs,) = status["filesystems"].values()
        assert len(fs["nodes"]) == 13, "all nodes share tmp_path's filesystem"
        one = max(n["capacity_bytes"] for n in nodes.values())
        assert status["capacity_bytes"] < 1.5 * one, "a shared filesystem counted more than once"

        drained = _kvstore("cluster", "drain", "--dir", str(root), "n03", "--timeout-s", "300")
        assert "node n03 drained" in drained.stdout and "(verified)" in drained.stdout
        refused = _kvstore("cluster", "drain", "--dir", str(root), "n03", check=False)
        assert refused.returncode == 1 and "not 'in'" in refused.stderr
        n03_pid = read_pids(root)["n03"]
        removed = _kvstore("cluster", "remove", "--dir", str(root), "n03")
        assert f"stopped its process (pid {n03_pid})" in removed.stdout
        assert not is_node_process(n03_pid, "n03")
        status = _status(root)
        assert "n03" not in {n["id"] for n in status["nodes"]} and not status["moving"]
    finally:
        down = _kvstore("cluster", "down", "--dir", str(root), check=False)
    assert "stopped 12 nodes" in down.stdout and "stopped etcd (pid" in down.stdout
    assert etcd_pid(root) is None
