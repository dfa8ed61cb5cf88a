"""Decode drain: a decode worker taken out mid-request (``Drain`` RPC, as ``kvstore serve
drain`` sends, or SIGTERM) hands its requests on with their KV (full blocks through the
store, the tail inline). Every request finishes exactly once with the tokens an undrained
run gives, and the drained worker exits without being restarted."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.router import Router
from engine_adapter.serving.worker_pool import WorkerPool
from tests.engine_adapter.serving.conftest import reference_generate

pytest.importorskip("torch")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(240)]

NUM_NEW_TOKENS = 24
SLOW_MS = "150"  # per token on the drained worker: it is mid-request when the drain comes


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(num_tokens)]


async def _wait_active(router: Router, worker_id: str, timeout_s: float = 60.0) -> None:
    worker = next(w for w in router.endpoints if w.worker_id == worker_id)
    deadline_s = time.monotonic() + timeout_s
    while (await worker.stub.Health(pb.HealthRequest(), timeout=5.0)).num_active == 0:
        assert time.monotonic() < deadline_s, f"{worker_id} was never given a request"
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["rpc", "sigterm"])
async def test_drained_decode_worker_hands_requests_on_unchanged(
    worker_pool: WorkerPool, reference_engine, how
):
    # Prompts shorter than a block: a request that moves mid-decode has filled a block with
    # generated tokens, which must reach the next worker through the store (the rest inline).
    prompts = [_prompt(40 + i, 60 + i) for i in range(4)]
    expected = [await reference_generate(reference_engine, p, NUM_NEW_TOKENS) for p in prompts]
    worker_pool.add("d1", "decode", ["--inject-delay-ms", SLOW_MS, "--drain-grace-s", "0.8"])
    d1 = worker_pool.workers["d1"]
    try:
        prefill, decode = (
            worker_pool.addresses("prefill"),
            [d1.address, worker_pool.workers["d0"].address],
        )
        async with Router(prefill, decode, policy="least-loaded") as router:
            # Decode workers in turn (d1, d0, d1, d0): d1 surely holds two requests, one
            # decoding (slowly) and one queued behind it, when the drain comes.
            router.decode.policy = "round-robin"
            requests = [
                asyncio.create_task(
                    router.generate(token_ids=p, tenant=how, max_new_tokens=NUM_NEW_TOKENS)
                )
                for p in prompts
            ]
            # d1 decodes one and has one queued; d0 runs the others. On a loaded machine the
            # prefills take longer: wait for d1 to hold a request too.
            await asyncio.sleep(2.0)
            await _wait_active(router, "d1")
            if how == "rpc":
                assert await router.drain("d1", grace_s=0.8) >= 1, "d1 held no request"
            else:
                os.kill(d1.proc.pid, signal.SIGTERM)
            completions = await asyncio.wait_for(asyncio.gather(*requests), 120)
        exit_code = await asyncio.to_thread(d1.proc.wait, 30)
        restarted = worker_pool.restart_dead()
    finally:
        worker_pool.remove("d1")
    for index, (completion, tokens) in enumerate(zip(completions, expected, strict=True)):
        assert completion.token_ids == tokens, (
            f"request {index} changed, lost or repeated tokens when it moved off d1 "
            f"(migrations {completion.num_migrations})"
        )
        assert completion.decode_worker_id == "d0", f"request {index} finished on a drained worker"
    assert sum(c.num_migrations for c in completions) >= 2, "nothing moved off d1"
    moved_mid_decode = [c for c in completions if c.num_migrations and c.num_swapped_tokens]
    assert moved_mid_decode, "no request moved mid-decode with generated KV in the store"
    assert all(c.num_recomputed_tokens == 0 for c in moved_mid_decode), (
        "the generated KV a drained worker stored was not readable by the next worker"
    )
    assert exit_code == 0 and restarted == [], "a drained worker must exit cleanly and stay down"
