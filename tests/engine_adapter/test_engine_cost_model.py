"""The fetch-or-compute cost model and the KV block layout: pure code, no torch."""

from __future__ import annotations

import pytest

from engine_adapter.config import RANDOM_PRESETS, STORE_TRANSPORTS, EngineConfig
from engine_adapter.cost_model import FetchCostModel
from engine_adapter.kv_layout import KVBlockLayout

MiB = 1 << 20


def trained(fetch_bytes_per_s: float, compute_tokens_per_s: float) -> FetchCostModel:
    model = FetchCostModel(ewma_weight=1.0, min_deadline_s=0.01, max_deadline_s=5.0)
    model.observe_latency(0.001)
    model.observe_fetch(num_bytes=int(fetch_bytes_per_s), seconds=1.001)
    model.observe_compute(num_tokens=int(compute_tokens_per_s), seconds=1.0)
    return model


def test_fetches_everything_when_fetching_is_faster():
    plan = trained(fetch_bytes_per_s=1e9, compute_tokens_per_s=500).plan(10, 64, 3 * MiB)
    assert plan.num_blocks == 10, "a fast store must be used"
    assert plan.predicted_fetch_s < plan.predicted_compute_s


def test_computes_when_the_store_is_slower_than_compute():
    plan = trained(fetch_bytes_per_s=1e6, compute_tokens_per_s=1e5).plan(10, 64, 3 * MiB)
    assert plan.num_blocks == 0, "fetching must not be chosen when it is predicted slower"


def test_computes_the_front_while_fetching_the_rest_when_both_take_time():
    # A 3 MiB block fetches in 3 ms, 64 tokens compute in 3.2 ms: they meet near the middle.
    model = trained(fetch_bytes_per_s=1e9, compute_tokens_per_s=20_000)
    model.fetch_latency_s = 0.0
    plan = model.plan(100, 64, 3 * MiB, chunk_blocks=4)
    assert plan.first_block % 4 == 0, "the split must fall on a prefill chunk"
    assert 40 <= plan.first_block <= 56 and plan.num_blocks == 100 - plan.first_block
    overlapped = max(
        model.compute_s(plan.first_block * 64), model.fetch_s(plan.num_blocks, 3 * MiB)
    )
    assert overlapped < min(model.fetch_s(100, 3 * MiB), model.compute_s(6400)), (
        "computing and loading at once must beat either alone"
    )


def test_always_fetches_everything():
    plan = trained(fetch_bytes_per_s=1e6, compute_tokens_per_s=1e5).plan(10, 64, MiB, True)
    assert (plan.first_block, plan.num_blocks) == (0, 10)


def test_explores_until_a_fetch_was_measured():
    model = FetchCostModel(fetch_bytes_per_s=1.0)  # a prior that says "never fetch"
    assert model.plan(4, 64, MiB).num_blocks == 4, "without a measurement the model must try"


def test_deadline_is_the_compute_time_clamped():
    model = trained(fetch_bytes_per_s=1e9, compute_tokens_per_s=1000)
    assert model.plan(10, 64, MiB).deadline_s == pytest.approx(0.64)
    assert model.plan(1000, 64, MiB).deadline_s == 5.0, "max_deadline_s must cap the deadline"
    assert model.plan(0, 64, MiB).deadline_s == 0.01, "min_deadline_s must floor the deadline"


def test_ewma_moves_towards_new_observations():
    model = FetchCostModel(ewma_weight=0.5, compute_tokens_per_s=100.0)
    model.observe_compute(num_tokens=300, seconds=1.0)
    assert model.compute_tokens_per_s == pytest.approx(200.0)
    model.observe_compute(num_tokens=0, seconds=1.0)  # nothing computed: no information
    assert model.compute_tokens_per_s == pytest.approx(200.0)


def test_namespace_separates_models_layouts_dtypes_and_block_sizes():
    cfg = RANDOM_PRESETS["135m"]
    base = KVBlockLayout.for_model(cfg, 64, "float32")
    variants = {
        base.namespace("model-a"),
        base.namespace("model-b"),
        KVBlockLayout.for_model(cfg, 128, "float32").namespace("model-a"),
        KVBlockLayout.for_model(cfg, 64, "bfloat16").namespace("model-a"),
        KVBlockLayout.for_model(RANDOM_PRESETS["1b"], 64, "float32").namespace("model-a"),
    }
    assert len(variants) == 5, "two different KV meanings share a namespace"


def test_block_size_of_the_default_model():
    layout = KVBlockLayout.for_model(RANDOM_PRESETS["135m"], 64, "float32")
    assert layout.shape == (30, 2, 3, 64, 64)
    assert (
        layout.block_bytes
        == 30 * 2 * 3 * 64 * 64 * 4
        == 64 * RANDOM_PRESETS["135m"].kv_bytes_per_token("float32")
    )


def test_engine_config_refuses_chunks_that_split_blocks():
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        EngineConfig(block_tokens=64, prefill_chunk_tokens=96)
    assert EngineConfig(block_tokens=16, prefill_chunk_tokens=64).blocks_per_chunk == 4


def test_engine_config_store_transport_is_one_the_client_knows():
    from client.kv_client import TRANSPORTS

    assert set(STORE_TRANSPORTS) == set(TRANSPORTS), "EngineConfig and KVClient disagree"
    assert EngineConfig().store_transport == "grpc"
    with pytest.raises(ValueError, match="store_transport 'rdma'"):
        EngineConfig(store_transport="rdma")
