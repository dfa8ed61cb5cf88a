"""`kvstore bench swapin` end to end on tiny blocks: one record per transport, bytes verified."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("torch")

from kvstore.cli.commands import main

pytestmark = pytest.mark.engine


def test_bench_swapin_measures_every_transport_and_verifies_bytes(tmp_path):
    out = tmp_path / "swapin.json"
    argv = ["bench", "swapin", "--json", str(out), "--transport", "grpc,ucx"]
    argv += ["--model", "random:small", "--block-tokens", "16", "--num-blocks", "8"]
    argv += ["--concurrency", "4", "--rounds", "2", "--no-fsync"]
    assert main(argv) == 0, "a block came back wrong or missing"
    report = json.loads(out.read_text())
    records = {r["transport"]: r for r in report["results"]}
    with_ucx = importlib.util.find_spec("ucxx") is not None
    assert sorted(records) == (["grpc", "ucx"] if with_ucx else ["grpc"])
    if not with_ucx:
        assert any(note.startswith("ucx skipped") for note in report["notes"])
    for record in records.values():
        assert record["block_bytes"] == 4 * 2 * 2 * 16 * 32 * 4 and record["num_blocks"] == 8
        assert record["bytes_verified"] and record["num_verified_blocks"] > 0
        assert record["incomplete_fetches"] == []
        assert record["gb_per_s"] > 0 and record["cache_gb_per_s"] > 0
        assert 0 < record["p50_ms"] <= record["p99_ms"]
        # The median fetch's timeline: a request per asked node, the client's stages.
        lanes = {(span["lane"], span["what"]) for span in record["timeline"]}
        assert sum(what == "request" for _, what in lanes) >= 10, sorted(lanes)
        assert {("client", "fetch"), ("client", "swap-in")} <= lanes
        assert record["stages_ms"]["first_send_to_last_answer"] > 0
    assert records["grpc"]["ucx_counters"] is None
    if with_ucx:
        ucx = records["ucx"]["ucx_counters"]
        assert ucx is not None, "the connector did not pass store_transport='ucx' to its client"
        assert ucx.get("num_ucx_replies", 1) > 0, "no read was answered over UCX"


def test_bench_swapin_e4m3x16_runs_beside_the_dtype_baseline(tmp_path):
    out = tmp_path / "swapin.json"
    argv = ["bench", "swapin", "--json", str(out), "--transport", "grpc", "--kv-format", "e4m3x16"]
    argv += ["--model", "random:small", "--block-tokens", "16", "--num-blocks", "8"]
    argv += ["--concurrency", "4", "--rounds", "2", "--no-fsync"]
    assert main(argv) == 0, "a block came back wrong or missing"
    report = json.loads(out.read_text())
    records = {r["kv_format"]: r for r in report["results"]}
    assert sorted(records) == ["e4m3x16", "float32"], "the dtype baseline must run beside it"
    values = 4 * 2 * 2 * 16 * 32  # layers, K/V, heads, tokens, head_dim
    assert records["e4m3x16"]["block_bytes"] == values * 18 // 16
    for record in records.values():
        assert record["bytes_verified"] and record["incomplete_fetches"] == []
        assert record["tokens_per_s"] > 0
        assert record["kv_bytes_per_token"] * 16 == record["block_bytes"]
    assert records["e4m3x16"]["tokens_per_s_vs_dtype"] > 0
    assert report["codec"]["cpu_s_per_gb"] > 0 and report["codec"]["memcpy_cpu_s_per_gb"] > 0
