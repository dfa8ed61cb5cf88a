"""``kvstore bench sim`` on a tiny workload: every case runs and the JSON says so (no timing
assertions: speed is reported, not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli.commands import main


def test_bench_writes_every_case(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "sim", "--days", "0.05", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    document = json.loads(out.read_text())
    cases = [r["case"] for r in document["results"]]
    assert cases == [
        *("dict-ttl", "sim-ttl", "sim-ttl-capacity-expiry", "sim-ttl-capacity-lru"),
        *("load-jsonl", "load-sessions", "e2e-jsonl-lru", "e2e-sessions-lru"),
    ], "loop-only and end-to-end (file to result) cases, for both loaders"
    by_case = {r["case"]: r for r in document["results"]}
    assert by_case["sim-ttl-capacity-lru"]["evicted_blocks"] > 0, "the capacity must bind"
    assert all(r["accesses_per_s"] > 0 for r in document["results"])
    assert document["target_accesses_per_s"] == 3e6
    assert "simulator speed" in capsys.readouterr().out


def test_scale_out_mode_compares_partitions_with_one_process(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "scale.json"
    rc = main(["bench", "sim", "--days", "0.05", "--partitions", "3,5", "--workers", "0",
               "--rounds", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    document = json.loads(out.read_text())
    results = document["results"]
    assert [r["case"] for r in results] == [
        "one-process", "partitions-3-workers-inline", "partitions-5-workers-inline"
    ]  # fmt: skip
    assert all(r["wall_s"] > 0 and r["speedup"] > 0 and r["cpu_s_total"] > 0 for r in results)
    one = results[0]
    for r in results[1:]:
        assert r["partition_cpu_ratio"] == pytest.approx(r["cpu_s_total"] / one["cpu_s_total"]), (
            "the contract: partitioned CPU over the one-process CPU of the same round"
        )
        assert abs(r["block_hit_diff_points"]) < 5, "partitions must answer like one cache"
    assert document["partition_cpu_ratio"] == max(r["partition_cpu_ratio"] for r in results[1:])
    assert set(document["partition_cpu_ratio_by_partitions"]) == {"3", "5"}
