"""A tiny run of `kvstore bench repair` end to end: writes through an outage, then the heal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_bench_repair_smoke(tmp_path: Path) -> None:
    out = tmp_path / "repair.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "repair", "--json", str(out)]
    command += ["--blocks", "20", "--block-bytes", "32KiB"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, f"bench failed:\n{run.stdout}\n{run.stderr}"
    report = json.loads(out.read_text())
    assert report["degraded"]["degraded_puts"] == 20, "puts with 2 nodes down were not degraded"
    heal = report["heal"]
    # The heal ends with every shard back, rebuilt: the bench settles the degraded puts'
    # background shard puts before it restarts the down nodes, so none of them lands there.
    assert 0 < heal["rebuilt_shards"] <= 2 * 20, heal
    # k = 10 survivors read per block rebuilt (5 per shard when both are missing); a little
    # more when a survivor failed and the next one was read, or a rebuild was repeated.
    assert 4.0 <= heal["read_per_rebuilt_byte"] <= 12.0, heal
    # The nodes' CPU net of their idle rate: a heal this small can cost less than the idle
    # estimate's noise, which the bench clamps to 0.
    assert heal["node_cpu_s"] >= 0 and heal["heal_s"] > 0


def test_bench_repair_churn_smoke(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "repair", "--churn", "--json"]
    command += [str(out), "--churn-seconds", "20", "--churn-every-s", "10", "--blocks", "20"]
    command += ["--block-bytes", "32KiB", "--concurrency", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, f"bench failed:\n{run.stdout}\n{run.stderr}"
    churn = json.loads(out.read_text())["churn"]
    assert churn["kills"] >= 1 and churn["gets"] > 0 and churn["blocks_acked"] >= 20, churn
    assert (churn["blocks_lost"], churn["wrong_bytes"]) == (0, 0), churn
    assert churn["heal_s"] >= 0, "the cluster did not heal after the churn"
    for name in ("misses_while_existing", "timeouts_reported", "get_p99_ms", "status_s_max"):
        assert name in churn, f"the churn JSON lacks {name}"


def test_bench_repair_restart_churn_smoke(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "repair", "--restart-churn"]
    command += ["--json", str(out), "--churn-seconds", "1", "--churn-every-s", "1"]
    command += ["--blocks", "20", "--block-bytes", "32KiB", "--concurrency", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, f"bench failed:\n{run.stdout}\n{run.stderr}"
    churn = json.loads(out.read_text())["churn"]
    cycle = churn["cycles"][0]
    assert churn["restart_cycles"] == 1 and churn["kills"] == 3, churn
    assert len({cycle["down"], cycle["returning"], cycle["killed_at_return"]}) == 3, cycle
    assert cycle["serving"] and "window_put_failures" in cycle, cycle
    assert (churn["blocks_lost"], churn["wrong_bytes"]) == (0, 0), churn
    assert churn["heal_s"] >= 0, "the cluster did not heal after the churn"
