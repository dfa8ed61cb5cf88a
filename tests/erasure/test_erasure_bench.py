"""Smoke test of ``kvstore bench erasure``: tiny sizes, a real process, JSON and table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import erasure_bench


def test_bench_erasure_writes_json_and_prints_a_table(tmp_path: Path) -> None:
    out = tmp_path / "erasure.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "erasure", "--json", str(out)]
    command += ["--block-sizes", "3001", "--seconds", "0.02", "--rounds", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"bench failed:\n{done.stdout}\n{done.stderr}"
    assert "erasure codec throughput" in done.stdout, "the table was not printed"

    report = json.loads(out.read_text())
    results = report["results"]
    keys = {(r["codec"], r["op"], r["block_bytes"], r["missing_data_shards"]) for r in results}
    for block_bytes in (3001,):
        assert ("none", "memcpy", block_bytes, 0) in keys, "memcpy yardstick missing"
        for codec in ("zfec", "isal"):
            for op, lost in [("encode", 0), ("decode", 0), ("decode", 2), ("decode_into", 2)]:
                assert (codec, op, block_bytes, lost) in keys, f"no {codec} {op} lost={lost}"
            assert (f"{codec}-raw", "encode", block_bytes, 0) in keys, f"no raw {codec} record"
        assert ("isal-kernel", "decode", block_bytes, 2) in keys, "no ISA-L kernel record"
    assert all(r["mb_per_s"] > 0 and r["wall_mb_per_s"] > 0 and r["vs_memcpy"] > 0 for r in results)
    ours = [r for r in results if r["codec"] in ("zfec", "isal")]
    assert all(r["raw_mb_per_s"] for r in ours), "our records lack the raw library's figure"
    assert report["k"] == 10 and report["m"] == 2 and report["malloc"] == "tuned"


def test_bench_rejects_more_missing_shards_than_parity(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    erasure_bench.configure(parser)
    assert erasure_bench.run(parser.parse_args(["--missing", "3"])) == 2
    assert "--missing" in capsys.readouterr().err
