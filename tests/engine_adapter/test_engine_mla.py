"""Cache-backed prefill of an MLA model (``random:mla-small``, DeepSeek's latent attention)
against a real 12-node local cluster: the latent blocks round-trip bitwise, cached and cold
prefill give the same first token, and an MLA model's blocks never meet a Llama's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from engine_adapter.loader import load_model  # noqa: E402
from tests.engine_adapter.store_harness import CONFIG  # noqa: E402

pytestmark = pytest.mark.engine
PROMPT = [(i * 53 + 7) % 1000 for i in range(203)]  # 12 full blocks and an 11-token tail


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster.start(tmp_path_factory.mktemp("mla-cluster"), fsync=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def mla_loaded():
    return load_model("random:mla-small", "cpu", "float32", seed=0)


async def prefill_kv(engine: Engine, **kwargs):
    """(result, serialised KV of every full block) of one prefill of PROMPT."""
    result = await engine.prefill(PROMPT, **kwargs)
    blocks = []
    for index in range(result.num_prompt_tokens // engine.config.block_tokens):
        out = torch.empty(engine.layout.shape)
        engine.cache.save_block(result.sequence.table.block_ids[index], out)
        blocks.append(out)
    engine.release(result.sequence)
    await engine.flush()
    return result, blocks


async def test_mla_cached_prefill_equals_cold_prefill(cluster, mla_loaded):
    engine = Engine(mla_loaded, CONFIG)
    engine.open_store(cluster.cluster_toml)
    assert engine.layout.latent and engine.layout.shape == (3, 1, 1, 16, 576)
    cold, cold_kv = await prefill_kv(engine, tenant="mla", use_cache=False)
    first, _ = await prefill_kv(engine, tenant="mla")
    assert first.num_cached_tokens == 0 and engine.connector.stats.num_written_blocks == 12
    cached, cached_kv = await prefill_kv(engine, tenant="mla")
    await engine.close()
    assert cached.num_cached_tokens == 12 * 16, f"every full latent block should hit: {cached}"
    assert cached.first_token_id == cold.first_token_id, "the cache changed the first token"
    assert torch.equal(cached.logits, cold.logits), "cached latents changed the logits"
    for index, (got, want) in enumerate(zip(cached_kv, cold_kv, strict=True)):
        assert torch.equal(got, want), f"block {index}: swapped-in latent differs from recomputed"


async def test_mla_and_llama_blocks_never_meet(cluster, mla_loaded, small_model):
    """Same tokens, same tenant: a Llama-style model and the MLA model keep apart."""
    mla = Engine(mla_loaded, CONFIG)
    mla.open_store(cluster.cluster_toml)
    await prefill_kv(mla, tenant="apart")
    llama = Engine(small_model, CONFIG)
    llama.open_store(cluster.cluster_toml)
    result, _ = await prefill_kv(llama, tenant="apart")
    await mla.close()
    await llama.close()
    assert result.num_matched_tokens == 0, "a Llama model hit an MLA model's latent blocks"
