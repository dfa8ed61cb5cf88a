"""``kvstore sim`` end to end on a small generated trace: JSON, Parquet, plots, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvstore.cli.commands import main
from ttl.generate import WorkloadParams, write_workload


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "w.jsonl"
    params = WorkloadParams(
        days=2.0, chat_sessions_per_day=60, agent_sessions_per_day=6, agent_turns=4, seed=3
    )
    write_workload(params, path)
    return path


def test_grid_writes_json_parquet_and_plots(trace_path: Path, tmp_path: Path, capsys) -> None:
    out, plots = tmp_path / "out" / "sim.json", tmp_path / "plots"
    rc = main([
        "sim", "--trace", str(trace_path), "--format", "mooncake", "--block-tokens", "128",
        "--ttl", "chat=1h,1d", "--ttl", "agent=inf", "--capacity", "50%,inf",
        "--policy", "expiry,lru", "--warmup", "0.1", "--json", str(out), "--plot-dir", str(plots),
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    document = json.loads(out.read_text())
    results = document["results"]
    assert len(results) == 2 * 2 * 2 * 3, "one record per (class or all, TTL, capacity, policy)"
    assert document["trace"]["classes"] == ["agent", "chat"]
    contract = (
        *("traffic_class", "ttl_s", "capacity_blocks", "requests", "block_hit_ratio"),
        *("token_hit_ratio", "tokens_saved", "peak_blocks", "mean_blocks", "byte_days"),
    )
    for record in results:
        missing = [key for key in contract if key not in record]
        assert not missing, f"JSON contract fields {missing} missing"
    agent = [r for r in results if r["traffic_class"] == "agent"]
    assert all(r["ttl_s"] is None for r in agent), "inf TTL must be null in JSON"
    assert {r["capacity_blocks"] is None for r in results} == {True, False}
    table = pq.read_table(out.with_suffix(".parquet"))
    assert table.num_rows == len(results), "Parquet next to the JSON with the same rows"
    assert (plots / "hit_ratio_vs_ttl.png").stat().st_size > 0
    assert (plots / "hit_ratio_vs_capacity.png").stat().st_size > 0
    assert "token hit" in capsys.readouterr().out


def test_bad_input_is_a_clear_error(trace_path: Path, capsys) -> None:
    assert main(["sim", "--trace", str(trace_path), "--ttl", "chat"]) == 2
    assert "CLASS=DURATION" in capsys.readouterr().err
    assert main(["sim", "--trace", str(trace_path), "--capacity", "1TiB", "--ttl", "chat=1d",
                 "--ttl", "agent=1d", "--capacity", "x"]) == 2  # fmt: skip
    assert "bad capacity 'x'" in capsys.readouterr().err
    assert main(["sim", "--trace", str(trace_path), "--policy", "fifo"]) == 2
    assert "choose from expiry, lru" in capsys.readouterr().err
    assert main(["sim", "--trace", str(trace_path / "missing")]) == 2
    assert "no trace at" in capsys.readouterr().err


def test_the_installed_command_runs(trace_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    command = [sys.executable, "-m", "kvstore.cli", "sim", "--trace", str(trace_path),
               "--block-tokens", "128", "--json", str(out)]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert len(json.loads(out.read_text())["results"]) == 3
