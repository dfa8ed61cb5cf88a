"""Cache-backed prefill when the store misbehaves: nodes down, a slow store, expired blocks.

Whatever happens, the answer is the one computed without a cache; only the number of cached
tokens changes. Each test runs its own 12-node cluster of real processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

torch = pytest.importorskip("torch")

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from tests.engine_adapter.store_harness import CONFIG  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]
PROMPT = [(i * 53 + 5) % 1000 for i in range(170)]  # 10 full blocks and a 10-token tail
DAY_S = 4.0  # real seconds a virtual day lasts in the TTL test
SLOW_STORE_S = 1.5  # every node answers this late in the deadline test


async def prefill(engine: Engine, prompt: list[int], **kwargs):
    result = await engine.prefill(prompt, **kwargs)
    engine.release(result.sequence)
    await engine.flush()
    return result


def brief(result) -> str:
    """What an assertion message needs from a PrefillResult (not its logits)."""
    return (
        f"cached {result.num_cached_tokens}, matched {result.num_matched_tokens}, "
        f"fallback {result.fallback}, fetch {result.fetch_s:.3f} s"
    )


async def test_two_nodes_down_still_hit_three_down_compute(tmp_path, small_model):
    with LocalCluster.start(tmp_path, fsync=False) as cluster:
        engine = Engine(small_model, CONFIG)
        engine.open_store(cluster.cluster_toml)
        cold = await prefill(engine, PROMPT, use_cache=False)
        await prefill(engine, PROMPT)
        cluster.kill_node("n03")
        cluster.kill_node("n07")
        degraded = await prefill(engine, PROMPT)
        cluster.kill_node("n11")
        lost = await prefill(engine, PROMPT)
        await engine.close()
    assert degraded.num_cached_tokens == 160, f"10+2 must survive 2 lost nodes: {brief(degraded)}"
    assert lost.num_cached_tokens == 0, f"with 3 nodes lost the blocks are gone: {brief(lost)}"
    for result in (degraded, lost):
        assert torch.equal(result.logits, cold.logits), "a degraded store changed the answer"


async def test_slow_store_hits_the_deadline_and_computes(tmp_path, small_model):
    with LocalCluster.start(tmp_path, fsync=False, inject_delay_ms=SLOW_STORE_S * 1e3) as cluster:
        writer = Engine(small_model, CONFIG)
        writer.open_store(cluster.cluster_toml)
        cold = await prefill(writer, PROMPT, use_cache=False)
        await prefill(writer, PROMPT)  # lookups and puts are slow, but they land
        await writer.close()
        hurried = dataclasses.replace(CONFIG, fetch_min_deadline_s=0.2, fetch_deadline_s=0.2)
        engine = Engine(small_model, hurried)
        engine.open_store(cluster.cluster_toml)
        started = time.perf_counter()
        result = await prefill(engine, PROMPT)
        elapsed_s = time.perf_counter() - started
        await engine.close()
    # The fetch is the lookup: with every answer 1.5 s away, none came before the deadline, so
    # nothing counts as matched and nothing as cached. The fetch gave up before any answer
    # came (a loaded machine may run the client's loop late, so not "at 0.2 s").
    assert result.fallback == "deadline", "the blocks were written; the fetch should have tried"
    assert result.num_matched_tokens == 0 and result.num_cached_tokens == 0
    assert result.fetch_s < SLOW_STORE_S, f"the fetch waited for the answers ({brief(result)})"
    assert elapsed_s < 2 * SLOW_STORE_S + 5.0
    assert torch.equal(result.logits, cold.logits), "the deadline fallback changed the answer"


async def test_expired_blocks_are_recomputed_and_classes_keep_their_ttl(tmp_path, small_model):
    # A virtual day lasts DAY_S real seconds: agent blocks (3 days) expire after 3 days, chat
    # (7) not. Four seconds a day leave a loaded machine 14 s between the two expiries.
    with LocalCluster.start(tmp_path, time_scale=86_400.0 / DAY_S, fsync=False) as cluster:
        engine = Engine(small_model, CONFIG)
        engine.open_store(cluster.cluster_toml)
        agent_prompt, chat_prompt = PROMPT, PROMPT[::-1]
        cold = await prefill(engine, agent_prompt, use_cache=False)
        writing_from = time.monotonic()  # no block is older than this
        await prefill(engine, agent_prompt, traffic_class="agent")
        await prefill(engine, chat_prompt, traffic_class="chat")
        await engine.flush()  # the write-backs run in the background: wait for them
        written_at = time.monotonic()  # ... nor younger than this
        await asyncio.sleep(max(0.0, 3.5 * DAY_S - (time.monotonic() - written_at)))
        engine.config = dataclasses.replace(CONFIG, write_back=False)
        expired = await prefill(engine, agent_prompt)
        alive = await prefill(engine, chat_prompt)
        await engine.close()
    assert time.monotonic() - writing_from < 6.5 * DAY_S, "too slow to tell the two TTLs apart"
    assert expired.num_matched_tokens == 0, "agent blocks outlived their 3-day TTL"
    assert alive.num_cached_tokens == 160, "chat blocks should live 7 days"
    assert torch.equal(expired.logits, cold.logits)
