"""The UCX transport microbenchmark runs end to end and writes one record per setting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import ucx_bench
from kvstore.ucx_worker import ucx_available

if not ucx_available():
    pytest.skip("the optional ucx extra (ucxx) is not installed", allow_module_level=True)


def test_bench_measures_every_transport(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    ucx_bench.configure(parser)
    out = tmp_path / "ucx.json"
    args = parser.parse_args(
        ["--json", str(out), "--sizes", "256KiB", "--concurrency", "2", "--seconds", "0.05",
         "--rounds", "1", "--transports", "grpc,ucx,ucx-tcp,ucx-rma"]
    )  # fmt: skip
    assert ucx_bench.run(args) == 0
    report = json.loads(out.read_text())
    records = {r["transport"]: r for r in report["results"]}
    assert set(records) == {"grpc", "ucx", "ucx-tcp", "ucx-rma"}, "a transport went missing"
    for record in records.values():
        assert record["block_bytes"] == 256 << 10 and record["concurrency"] == 2
        assert record["gb_per_s"] > 0 and record["num_gets"] > 0, f"no GETs measured: {record}"
