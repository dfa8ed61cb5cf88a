"""The engine configuration shared by the tests that run prefill against a real cluster."""

from __future__ import annotations

from engine_adapter.config import EngineConfig

# "always" and a long deadline keep these tests deterministic on a loaded machine; the cost
# model and the deadline have their own tests.
CONFIG = EngineConfig(
    block_tokens=16,
    prefill_chunk_tokens=16,
    max_model_len=1024,
    fetch_policy="always",
    fetch_min_deadline_s=2.0,
    fetch_deadline_s=5.0,
)
