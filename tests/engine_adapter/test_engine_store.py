"""Cache-backed prefill against a real 12-node local cluster: same answers, bitwise same KV."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from deploy.local_cluster import LocalCluster, local_config  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from engine_adapter.loader import load_model  # noqa: E402
from kvstore.config import save_cluster  # noqa: E402
from tests.engine_adapter.store_harness import CONFIG  # noqa: E402

pytestmark = pytest.mark.engine
PROMPT = [(i * 37 + 11) % 1000 for i in range(203)]  # 12 full blocks and an 11-token tail


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster.start(tmp_path_factory.mktemp("engine-cluster"), fsync=False) as cluster:
        yield cluster


def make_engine(loaded, cluster, config=CONFIG) -> Engine:
    engine = Engine(loaded, config)
    engine.open_store(cluster.cluster_toml)
    return engine


def full_block_kv(engine: Engine, result) -> list:
    """Serialised KV of every full block of the prefilled prompt."""
    blocks = []
    for index in range(result.num_prompt_tokens // engine.config.block_tokens):
        out = torch.empty(engine.layout.shape)
        engine.cache.save_block(result.sequence.table.block_ids[index], out)
        blocks.append(out)
    return blocks


async def prefill_kv(engine: Engine, prompt: list[int], **kwargs):
    """(result, full-block KV) of one prefill; the sequence is released afterwards."""
    result = await engine.prefill(prompt, **kwargs)
    kv = full_block_kv(engine, result)
    engine.release(result.sequence)
    await engine.flush()
    return result, kv


async def test_swapped_in_kv_is_bitwise_recomputed_kv(cluster, small_model):
    engine = make_engine(small_model, cluster)
    cold, cold_kv = await prefill_kv(engine, PROMPT, tenant="bitwise", use_cache=False)
    first, _ = await prefill_kv(engine, PROMPT, tenant="bitwise")
    assert first.num_cached_tokens == 0 and engine.connector.stats.num_written_blocks == 12
    cached, cached_kv = await prefill_kv(engine, PROMPT, tenant="bitwise")
    await engine.close()
    assert cached.num_cached_tokens == 12 * 16, f"expected every full block cached: {cached}"
    assert cached.num_computed_tokens == 11, "only the tail should have been computed"
    assert torch.equal(cached.logits, cold.logits), "cached prefill changed the logits"
    for index, (got, want) in enumerate(zip(cached_kv, cold_kv, strict=True)):
        assert torch.equal(got, want), f"block {index}: swapped-in KV differs from recomputed KV"


async def test_generation_is_identical_with_and_without_cache(cluster, small_model):
    engine = make_engine(small_model, cluster)
    kwargs = {"max_new_tokens": 12, "temperature": 0.9, "seed": 7, "tenant": "gen"}
    cold = await engine.generate(PROMPT, use_cache=False, **kwargs)
    await engine.generate(PROMPT, **kwargs)  # writes the blocks
    await engine.flush()
    cached = await engine.generate(PROMPT, **kwargs)
    await engine.close()
    assert cached.prefill.num_cached_tokens == 192
    assert cached.token_ids == cold.token_ids, "the cache changed what the model generates"


async def test_whole_prompt_cached_still_computes_the_last_block(cluster, small_model):
    engine = make_engine(small_model, cluster)
    prompt = PROMPT[:160]  # exactly 10 blocks
    cold, _ = await prefill_kv(engine, prompt, tenant="whole", use_cache=False)
    await prefill_kv(engine, prompt, tenant="whole")
    cached, _ = await prefill_kv(engine, prompt, tenant="whole")
    await engine.close()
    assert (cached.num_cached_tokens, cached.num_computed_tokens) == (144, 16)
    assert cached.num_matched_tokens == 144, "the last block must not even be looked up"
    assert torch.equal(cached.logits, cold.logits)


async def test_deleted_blocks_are_recomputed_with_the_same_answer(cluster, small_model):
    engine = make_engine(small_model, cluster)
    cold, cold_kv = await prefill_kv(engine, PROMPT, tenant="deleted", use_cache=False)
    await prefill_kv(engine, PROMPT, tenant="deleted")
    keys = engine.connector.keys(PROMPT, "deleted")
    kv = await engine.connector.client("deleted")
    await kv.delete(keys[5:6])  # a hole after five blocks
    engine.config = dataclasses.replace(CONFIG, write_back=False)
    cached, cached_kv = await prefill_kv(engine, PROMPT, tenant="deleted")
    await engine.close()
    assert (cached.num_matched_tokens, cached.num_cached_tokens) == (80, 80)
    assert torch.equal(cached.logits, cold.logits)
    assert all(torch.equal(a, b) for a, b in zip(cached_kv, cold_kv, strict=True))


async def _cluster_misses(kv) -> int:
    return sum(reply.misses for reply in (await kv.node_stats()).values() if reply is not None)


async def prefill_counting_misses(engine: Engine, prompt: list[int], tenant: str):
    """(result, shard misses the cluster's nodes counted during it) of one prefill."""
    kv = await engine.connector.client(tenant)
    before = await _cluster_misses(kv)
    result, _ = await prefill_kv(engine, prompt, tenant=tenant)
    return result, await _cluster_misses(kv) - before


async def test_a_fetch_stops_asking_past_its_first_miss(cluster, small_model):
    # Only the leading run of cached blocks is used: after the chunk that holds the first
    # miss, no node is asked for the blocks beyond it (one chunk of 2 blocks in flight).
    writer = make_engine(small_model, cluster)
    await prefill_kv(writer, PROMPT[:96], tenant="first-miss")  # blocks 0-5 stored
    await writer.close()
    config = dataclasses.replace(CONFIG, fetch_chunk_blocks=2, fetch_concurrency=2)
    engine = make_engine(small_model, cluster, dataclasses.replace(config, write_back=False))
    cached, misses = await prefill_counting_misses(engine, PROMPT, "first-miss")
    await engine.close()
    assert (cached.num_matched_tokens, cached.fallback) == (96, "miss")
    # Blocks 6 and 7 miss on the (at most 12) nodes asked; blocks 8-11 are never asked.
    assert 0 < misses <= 2 * 12, f"{misses} shard misses: blocks past the first miss were asked"


async def test_a_prompt_the_store_lacks_asks_for_its_first_chunk_only(cluster, small_model):
    # Every chunk may be in flight at once (6 chunks of 2 blocks), yet the first goes out
    # alone until its last block lands a shard: the store lacks it, so no other is asked.
    # A prompt the store holds still comes whole through every chunk.
    config = dataclasses.replace(CONFIG, fetch_chunk_blocks=2, fetch_concurrency=12)
    engine = make_engine(small_model, cluster, dataclasses.replace(config, write_back=False))
    cold, misses = await prefill_counting_misses(engine, PROMPT, "lacking")
    assert (cold.num_matched_tokens, cold.fallback) == (0, "miss")
    assert 0 < misses <= 2 * 12, f"{misses} shard misses: chunks past the first were asked"
    writer = make_engine(small_model, cluster)
    await prefill_kv(writer, PROMPT, tenant="held")
    await writer.close()
    cached, _ = await prefill_kv(engine, PROMPT, tenant="held")
    await engine.close()
    assert (cached.num_matched_tokens, cached.fallback) == (192, None)
    assert torch.equal(cached.logits, cold.logits)


async def test_fetch_deadline_exceeded_falls_back_to_compute(cluster, small_model):
    writer = make_engine(small_model, cluster)
    cold, _ = await prefill_kv(writer, PROMPT, tenant="deadline", use_cache=False)
    await prefill_kv(writer, PROMPT, tenant="deadline")
    await writer.close()
    hurried = dataclasses.replace(CONFIG, fetch_deadline_s=1e-4, fetch_min_deadline_s=1e-4)
    engine = make_engine(small_model, cluster, hurried)
    result, _ = await prefill_kv(engine, PROMPT, tenant="deadline")
    await engine.close()
    assert result.num_cached_tokens == 0, "a fetch past its deadline must not be waited for"
    assert result.fallback == "deadline" and engine.connector.stats.num_deadlines_exceeded == 1
    assert torch.equal(result.logits, cold.logits), "a fallback changed the answer"


async def test_cost_model_can_choose_to_compute(cluster, small_model):
    engine = make_engine(small_model, cluster, dataclasses.replace(CONFIG, fetch_policy="cost"))
    cold, _ = await prefill_kv(engine, PROMPT, tenant="cost", use_cache=False)
    await prefill_kv(engine, PROMPT, tenant="cost")
    model = engine.connector.cost_model
    model.fetch_bytes_per_s, model.num_fetches = 1.0, 1  # "the store is hopelessly slow"
    result, _ = await prefill_kv(engine, PROMPT, tenant="cost")
    await engine.close()
    assert (result.num_front_tokens, result.num_cached_tokens) == (192, 0), (
        "a hopelessly slow store must not be fetched from: every usable block is computed"
    )
    assert result.fallback == "cost" and engine.connector.stats.num_skipped_by_cost == 12
    assert torch.equal(result.logits, cold.logits)


async def test_compute_and_load_meet_in_the_middle(cluster, small_model):
    """With fetching and computing predicted equally fast, the engine computes the first
    blocks while it fetches the others (Cake), and the answer is the cold one."""
    engine = make_engine(small_model, cluster, dataclasses.replace(CONFIG, fetch_policy="cost"))
    cold, cold_kv = await prefill_kv(engine, PROMPT, tenant="meet", use_cache=False)
    await prefill_kv(engine, PROMPT, tenant="meet")
    model = engine.connector.cost_model
    block_bytes, block_tokens = engine.layout.block_bytes, engine.layout.block_tokens
    # A block takes 1 s to fetch and 1 s to compute: the plan splits the 12 usable blocks.
    model.fetch_latency_s, model.num_fetches = 0.0, 1
    model.fetch_bytes_per_s, model.compute_tokens_per_s = block_bytes, block_tokens
    engine.config = dataclasses.replace(engine.config, write_back=False)
    result, result_kv = await prefill_kv(engine, PROMPT, tenant="meet")
    await engine.close()
    assert result.num_front_tokens == 96 and result.num_cached_tokens == 96, (
        f"the plan should compute 6 blocks and fetch 6: {result.num_front_tokens} computed "
        f"in front, {result.num_cached_tokens} fetched"
    )
    assert result.fallback == "cost"
    assert torch.equal(result.logits, cold.logits), "meeting in the middle changed the answer"
    for index, (got, want) in enumerate(zip(result_kv, cold_kv, strict=True)):
        assert torch.equal(got, want), f"block {index}: KV differs from recomputed KV"


async def test_other_models_layouts_dtypes_and_tenants_never_hit(cluster, small_model):
    writer = make_engine(small_model, cluster)
    await prefill_kv(writer, PROMPT, tenant="acme")
    await writer.close()
    other_weights = load_model("random:small", "cpu", "float32", seed=1)
    readers = {
        "other weights": (make_engine(other_weights, cluster), "acme"),
        "other block size": (
            make_engine(
                small_model,
                cluster,
                dataclasses.replace(CONFIG, block_tokens=32, prefill_chunk_tokens=32),
            ),
            "acme",
        ),
        "other dtype": (
            make_engine(
                load_model("random:small", "cpu", "bfloat16", seed=0),
                cluster,
                dataclasses.replace(CONFIG, dtype="bfloat16"),
            ),
            "acme",
        ),
        "other tenant": (make_engine(small_model, cluster), "globex"),
    }
    for what, (engine, tenant) in readers.items():
        result, _ = await prefill_kv(engine, PROMPT, tenant=tenant)
        await engine.close()
        assert result.num_matched_tokens == 0, f"{what} hit another's KV blocks"


async def test_unreachable_store_is_a_miss_not_an_error(tmp_path, small_model):
    dead = local_config(tmp_path, 12)  # ports nobody listens on
    save_cluster(dead, tmp_path / "cluster.toml")
    engine = Engine(small_model, dataclasses.replace(CONFIG, write_back=False))
    engine.open_store(tmp_path / "cluster.toml")
    cold = await engine.generate(PROMPT, use_cache=False, max_new_tokens=4)
    result = await engine.generate(PROMPT, max_new_tokens=4)
    await engine.close()
    assert result.prefill.num_cached_tokens == 0 and result.token_ids == cold.token_ids


async def test_default_model_greedy_answer_is_identical_from_the_cache(cluster, default_model):
    engine = make_engine(default_model, cluster, dataclasses.replace(CONFIG, max_model_len=512))
    messages = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    cold = await engine.generate(messages, max_new_tokens=12, use_cache=False, tenant="smol")
    await engine.generate(messages, max_new_tokens=1, tenant="smol")
    await engine.flush()
    cached = await engine.generate(messages, max_new_tokens=12, tenant="smol")
    await engine.close()
    assert "Paris" in cold.text, f"the real model should know this: {cold.text!r}"
    assert cached.prefill.num_cached_tokens > 0
    assert cached.token_ids == cold.token_ids, "the cache changed SmolLM2's greedy answer"
