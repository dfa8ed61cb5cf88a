"""End to end through the router with real worker processes and a real 12-node cluster.

The prompt's KV reaches the decode worker through the store, so a wrong block key, a wrong
block layout, a lost tail or a wrong first token would all change the generated tokens.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from client import KVClient
from engine_adapter.serving.admission import AdmissionConfig
from engine_adapter.serving.errors import ContextTooLong, QueueFull
from engine_adapter.serving.router import Router
from engine_adapter.serving.worker_pool import WorkerPool
from kvstore.errors import DeadlineExceeded, InvalidArgument
from tests.engine_adapter.serving.conftest import BLOCK_TOKENS, reference_generate

pytest.importorskip("torch")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

# Prompt lengths: inside the first block, exactly two blocks, blocks plus a tail.
PROMPT_LENGTHS = (40, 2 * BLOCK_TOKENS, 3 * BLOCK_TOKENS + 17)


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(num_tokens)]


def _router(pool: WorkerPool, policy: str = "round-robin") -> Router:
    return Router(pool.addresses("prefill"), pool.addresses("decode"), policy=policy)


@pytest.mark.parametrize("num_tokens", PROMPT_LENGTHS)
async def test_greedy_output_matches_in_process_engine(worker_pool, reference_engine, num_tokens):
    prompt = _prompt(num_tokens, num_tokens)
    expected = await reference_generate(reference_engine, prompt, max_new_tokens=12)
    async with _router(worker_pool) as router:
        cold = await router.generate(token_ids=prompt, tenant="e2e", max_new_tokens=12)
        warm = await router.generate(token_ids=prompt, tenant="e2e", max_new_tokens=12)
    assert cold.token_ids == expected, (
        "serving (cold) differs from the in-process model: handoff bug"
    )
    assert warm.token_ids == expected, "serving with cached blocks differs: swapped-in KV is wrong"
    num_full_blocks = num_tokens // BLOCK_TOKENS
    assert cold.num_swapped_tokens == num_full_blocks * BLOCK_TOKENS, (
        "the decode worker did not read every full prompt block from the store"
    )
    assert cold.num_recomputed_tokens == 0, "blocks written before the handoff were not readable"
    assert cold.finish_reason == "length" and len(cold.token_ids) == 12


async def test_seeded_sampling_matches_and_repeats(worker_pool, reference_engine):
    prompt = _prompt(7, 150)
    expected = await reference_generate(reference_engine, prompt, 10, temperature=0.8, seed=42)
    async with _router(worker_pool) as router:
        first = await router.generate(
            token_ids=prompt, tenant="e2e", max_new_tokens=10, temperature=0.8, seed=42
        )
        other_seed = await router.generate(
            token_ids=prompt, tenant="e2e", max_new_tokens=10, temperature=0.8, seed=43
        )
    assert first.token_ids == expected, (
        "seeded sampling differs from the in-process model: the sampler state was not handed off"
    )
    assert other_seed.token_ids != expected, "the seed does not reach the sampler"


async def test_prefix_written_by_one_prefill_worker_is_hit_by_the_other(worker_pool):
    prompt = _prompt(11, 4 * BLOCK_TOKENS + 5)
    async with _router(worker_pool) as router:
        writer = await router.generate(token_ids=prompt, tenant="cross", max_new_tokens=2)
        reader = await router.generate(token_ids=prompt, tenant="cross", max_new_tokens=2)
        longer = await router.generate(
            token_ids=prompt + [3] * 80, tenant="cross", max_new_tokens=2
        )
    assert writer.num_cached_tokens == 0, "a fresh tenant's prompt hit: keys are not salted"
    assert writer.prefill_worker_id != reader.prefill_worker_id, (
        "round-robin sent both to one worker"
    )
    assert reader.num_cached_tokens == 4 * BLOCK_TOKENS, (
        f"{reader.prefill_worker_id} did not hit the prefix {writer.prefill_worker_id} wrote"
    )
    assert longer.num_cached_tokens == 4 * BLOCK_TOKENS
    assert reader.token_ids == writer.token_ids


async def test_least_loaded_spreads_concurrent_requests(worker_pool):
    async with _router(worker_pool, policy="least-loaded") as router:
        completions = await asyncio.gather(
            *(
                router.generate(token_ids=_prompt(100 + i, 90), tenant="spread", max_new_tokens=2)
                for i in range(4)
            )
        )
    workers = sorted(c.prefill_worker_id for c in completions)
    assert workers == ["p0", "p0", "p1", "p1"], f"least-loaded routing gave {workers}"


async def test_tenants_do_not_share_kv_and_traffic_class_reaches_the_store(
    worker_pool, serving_cluster
):
    prompt = _prompt(21, 3 * BLOCK_TOKENS)

    async def agent_blocks() -> int:
        async with KVClient.connect(serving_cluster.cluster_toml, tenant="stats") as kv:
            stats = await kv.node_stats()
        return sum(
            c.blocks for s in stats.values() if s for c in s.classes if c.traffic_class == "agent"
        )

    before = await agent_blocks()
    async with _router(worker_pool) as router:
        acme = await router.generate(token_ids=prompt, tenant="acme", traffic_class="agent")
        globex = await router.generate(token_ids=prompt, tenant="globex", traffic_class="agent")
        acme_again = await router.generate(token_ids=prompt, tenant="acme", traffic_class="agent")
    assert acme.num_cached_tokens == 0, "a fresh prompt hit"
    assert globex.num_cached_tokens == 0, "tenant globex hit tenant acme's blocks"
    assert acme_again.num_cached_tokens == 2 * BLOCK_TOKENS
    # 2 tenants x 3 blocks, 12 shards each (some shards may still be in flight: >= 11 each).
    assert await agent_blocks() - before >= 2 * 3 * 11, "puts did not carry traffic_class=agent"


async def test_bad_requests_fail_cleanly(worker_pool):
    async with _router(worker_pool) as router:
        with pytest.raises(InvalidArgument, match="traffic class"):
            await router.generate(token_ids=[1, 2, 3], traffic_class="nope")
        with pytest.raises(InvalidArgument, match="no tokenizer"):
            await router.generate(messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(ContextTooLong, match="context of 1024 tokens"):
            await router.generate(token_ids=[1] * 1000, max_new_tokens=100)
        ok = await router.generate(token_ids=[1, 2, 3], max_new_tokens=3)
    assert len(ok.token_ids) == 3, "a worker is broken after rejecting bad requests"


async def test_cancelled_requests_leave_no_trace_in_the_next(worker_pool, reference_engine):
    """A caller that gives up mid-prefill or mid-decode cancels the worker's RPC while its
    compute thread runs; the next request on that worker must still be exact (the blocks of
    the cancelled request may not be reused before its thread is done with them)."""
    long_prompt = _prompt(31, 900)
    prompt = _prompt(32, 300)
    expected = await reference_generate(reference_engine, prompt, 8)
    async with _router(worker_pool, policy="least-loaded") as router:
        for timeout_s in (0.02, 0.05, 0.1):  # mid-prefill to mid-decode (100 tokens: ~0.2 s)
            with pytest.raises(DeadlineExceeded):
                await router.generate(
                    token_ids=long_prompt, tenant="cancel", max_new_tokens=100, timeout_s=timeout_s
                )
            completion = await router.generate(token_ids=prompt, tenant="cancel", max_new_tokens=8)
            assert completion.token_ids == expected, (
                f"after a request cancelled at {timeout_s} s the next one differs: a cancelled "
                "request's compute thread wrote into blocks handed to the next request"
            )


async def test_a_full_queue_is_refused_exactly_when_refusal_says_so(worker_pool):
    """One slot, one queue place: with one request running and one queued, ``refusal()``
    (what the HTTP front's /health answers) is QueueFull, and a third request gets exactly
    that at once; once they are done, both say the router takes requests again."""
    admission = AdmissionConfig(max_running_requests=1, max_waiting_requests=1)
    router = Router(*(worker_pool.addresses(r) for r in ("prefill", "decode")), admission=admission)
    async with router:
        assert router.refusal() is None
        long = [
            asyncio.create_task(
                router.generate(token_ids=_prompt(40 + i, 200), tenant="queue", max_new_tokens=300)
            )
            for i in range(2)
        ]
        while (router.admission.num_running, router.admission.num_waiting) != (1, 1):
            await asyncio.sleep(0.01)
        refusal = router.refusal()
        assert isinstance(refusal, QueueFull) and refusal.code == "queue_full"
        with pytest.raises(QueueFull, match="queued"):
            await router.generate(token_ids=[1, 2, 3], tenant="queue", max_new_tokens=1)
        done = await asyncio.gather(*long)
        assert [len(c.token_ids) for c in done] == [300, 300]
        assert router.refusal() is None
        assert len((await router.generate(token_ids=[1, 2, 3], max_new_tokens=2)).token_ids) == 2
