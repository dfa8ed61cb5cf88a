"""`kvstore bench capacity-fill --local` end to end on two small real clusters (issue 38)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_capacity_fill_local_fills_real_clusters_past_their_limits(tmp_path: Path) -> None:
    out = tmp_path / "fill.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "capacity-fill", "--local"]
    command += [str(tmp_path / "clusters"), "--nodes", "12", "--small", "1"]
    command += ["--small-shards", "150", "--block-bytes", "64KiB", "--json", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, f"bench failed:\n{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert [r["cluster"] for r in result["rows"]] == [
        "equal nodes, same total",
        "small nodes, weighted",
    ]
    for row in result["rows"]:
        # 12 nodes in groups of 12: every node holds a shard of every block, so a fill of 3x
        # the small node's share must evict, and the whole block goes.
        assert 0 < row["hit_ratio"] < 1, row
        assert row["evicted_blocks_counted"] > 0, row
        for node_id, held in row["nodes_after"].items():
            assert held["used_bytes"] <= held["limit_bytes"], (node_id, held)
    limits = result["node_limits_bytes"]
    assert limits["big"] == 2 * limits["small"], limits
