"""`kvstore bench engine` end to end on a tiny model: JSON shape and sanity of the figures."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvstore.cli.commands import main

pytestmark = pytest.mark.engine


def test_bench_engine_writes_every_setting(tmp_path):
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--json", str(out), "--model", "random:small"]
    argv += ["--prompt-lengths", "128,256", "--cached-fractions", "0,0.9", "--repeats", "1"]
    # "always": a model this small computes 224 tokens faster than any fetch, so the default
    # cost policy would (rightly) fetch nothing and leave no fetch row to check.
    argv += ["--block-tokens", "16", "--nodes", "12", "--fetch-policy", "always"]
    assert main(argv) == 0, "a cached run produced a different first token than the cold run"
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["prompt_tokens"], r["cached_fraction"]) for r in rows] == [
        (128, 0.0),
        (128, 0.9),
        (256, 0.0),
        (256, 0.9),
    ]
    for row in rows:
        for key in ("ttft_s", "ttft_cold_s", "speedup", "ideal_speedup", "ratio_to_ideal"):
            assert row[key] > 0, f"{key} missing or not positive in {row}"
    assert rows[3]["cached_tokens"] == 224 and rows[3]["fetch_gb_per_s"] > 0
    assert 0 < rows[3]["place_s"] < rows[3]["compute_s"], "CPU placing is a part of compute"
    assert rows[2]["cached_tokens"] == 0 and rows[2]["ideal_speedup"] == 1.0
    assert rows[2]["place_s"] == 0, "nothing fetched, nothing placed"
    assert report["config"]["block_bytes"] == 4 * 2 * 2 * 16 * 32 * 4
    assert all(r["kv_format"] == "float32" and r["kv_bytes_per_token"] > 0 for r in rows)
