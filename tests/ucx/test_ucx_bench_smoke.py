"""The UCX transport microbenchmark runs end to end and writes one record per setting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import ucx_bench
from kvstore.wire.ucx_worker import ucx_available

if not ucx_available():
    pytest.skip("the optional ucx extra (ucxx) is not installed", allow_module_level=True)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ucx_bench.configure(parser)
    return parser.parse_args(list(argv))


def test_bench_measures_every_transport(tmp_path: Path) -> None:
    out = tmp_path / "ucx.json"
    args = _args(
        "--json", str(out), "--sizes", "256KiB", "--concurrency", "2", "--seconds", "0.05",
        "--rounds", "1", "--transports", "grpc,ucx,ucx-tcp",
    )  # fmt: skip
    assert ucx_bench.run(args) == 0
    report = json.loads(out.read_text())
    records = {r["transport"]: r for r in report["results"]}
    assert set(records) == {"grpc", "ucx", "ucx-tcp"}, "a transport went missing"
    for record in records.values():
        assert record["block_bytes"] == 256 << 10 and record["concurrency"] == 2
        assert record["destination"] == "host", "host memory is the default destination"
        assert record["gb_per_s"] > 0 and record["num_gets"] > 0, f"no GETs measured: {record}"


def test_cuda_destination_without_cuda_is_skipped_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, cuda_missing = ucx_bench.cuda_torch()
    if cuda_missing is None:
        pytest.skip("CUDA is present: the cuda destination is measured, not skipped")
    out = tmp_path / "ucx.json"
    args = _args(
        "--json", str(out), "--sizes", "256KiB", "--concurrency", "1", "--seconds", "0.05",
        "--rounds", "1", "--transports", "ucx", "--destination", "cuda",
    )  # fmt: skip
    assert ucx_bench.run(args) == 0, "a missing GPU is a note, not a failure"
    printed = capsys.readouterr().out
    assert f"note: {cuda_missing}: skipping destination cuda" in printed, printed
    report = json.loads(out.read_text())
    assert report["results"] == [], "nothing was left to measure"
    assert any("skipping destination cuda" in note for note in report["settings"]["skipped"])
