"""Cancellation at any await of a worker's request path gives back everything (issue 42).

A prefill and a decode worker run in this process, on real engines and the session's real
12-node cluster; their RPC handlers are called as grpc.aio calls them. Each request is
cancelled after 0, 1, 2, ... event-loop turns (the task that cancels yields one turn at a
time), alone and while the engine is granted to it from another request in that very turn,
until one run finishes uncancelled; after every cancellation the engine's lock must be free,
the worker's counts and gauges back at zero and its KV blocks back in the pool. The first
``DENSE_TURNS`` turns are each tried; after them (where thread work spans many turns) every
``SPARSE_STRIDE``-th, unless the run is marked slow.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from deploy.local_cluster import LocalCluster
from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.worker_base import WorkerBase
from tests.engine_adapter.serving.conftest import BLOCK_TOKENS, MODEL

pytest.importorskip("torch")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

DENSE_TURNS = 64
SPARSE_STRIDE = 16
MAX_TURNS = 200_000  # a bound on the search, far past any request's length in turns
TENANT = "cancel"


class _Context:
    """What a handler uses of grpc.aio's ServicerContext (no TLS here: no peer checks)."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise grpc.aio.AbortError(f"{code}: {details}")


def _worker(role: str, cluster: LocalCluster) -> WorkerBase:
    from engine_adapter.engine import Engine
    from engine_adapter.serving.decode_worker import DecodeWorker
    from engine_adapter.serving.prefill_worker import PrefillWorker
    from engine_adapter.serving.worker_main import engine_config

    engine = Engine.load(MODEL, engine_config(role, BLOCK_TOKENS, 512, seed=0))
    engine.open_store(cluster.cluster_toml)
    worker_type = PrefillWorker if role == "prefill" else DecodeWorker
    return worker_type(f"{role[0]}-cancel", engine, cluster.cluster_toml)


def _assert_released(worker: WorkerBase, what: str) -> None:
    turns, metrics = worker.turns, worker.metrics
    assert not turns.held, f"{what}: the engine lock leaked; every later request would wait"
    assert turns.num_waiting == 0, f"{what}: a cancelled request kept its place in the queue"
    assert worker.num_active == 0, f"{what}: num_active stayed {worker.num_active}"
    for gauge in (metrics.waiting, metrics.running):
        assert gauge._value.get() == 0, f"{what}: a worker gauge stayed {gauge._value.get()}"
    pool = worker.engine.cache.pool
    assert pool.num_free == pool.num_blocks, f"{what}: KV blocks were not freed"


async def _drain(events: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in events]


def _turns_to_try(slow: bool) -> Callable[[int], int]:
    return lambda n: n + 1 if slow or n < DENSE_TURNS else n + SPARSE_STRIDE


async def _cancel_at_every_turn(
    worker: WorkerBase, call: Callable[[], AsyncIterator[Any]], slow: bool
) -> int:
    """Cancel ``call()`` after n turns for n = 0, 1, ... until a run ends uncancelled; each
    cancellation alone and while another request hands the engine over in that turn.
    Returns the turns the uncancelled run took."""
    next_n = _turns_to_try(slow)
    n = 0
    while n < MAX_TURNS:
        for contended in (False, True):
            holder = asyncio.create_task(_hold_for(worker, n)) if contended else None
            await asyncio.sleep(0)
            task = asyncio.create_task(_drain(call()))
            for _ in range(n):
                await asyncio.sleep(0)
            finished = task.done()
            task.cancel()
            await asyncio.gather(task, *([holder] if holder else []), return_exceptions=True)
            where = "behind another request" if contended else "alone"
            _assert_released(worker, f"{worker.role}, cancelled after {n} turns ({where})")
            if finished and not contended:
                assert not task.cancelled() and task.exception() is None, task
                return n
        n = next_n(n)
    raise AssertionError(f"{worker.role}: the request did not finish within {MAX_TURNS} turns")


async def _hold_for(worker: WorkerBase, num_turns: int) -> None:
    """Another request: holds the engine ``num_turns`` turns, so it is granted to the
    cancelled one just as that is cancelled."""
    async with worker.turns.turn("other") as holds:
        assert holds
        for _ in range(num_turns):
            await asyncio.sleep(0)


def _prefill_request(seed: int) -> pb.PrefillRequest:
    rng = random.Random(seed)
    return pb.PrefillRequest(
        request_id=f"cancel-{seed}",
        tenant=TENANT,
        traffic_class="chat",
        token_ids=[rng.randrange(1024) for _ in range(BLOCK_TOKENS + 7)],
        sampling=pb.SamplingParams(max_new_tokens=3, ignore_eos=True),
    )


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
async def test_prefill_cancelled_at_every_turn_releases_everything(
    serving_cluster: LocalCluster, slow: bool
):
    worker = _worker("prefill", serving_cluster)
    try:
        request = _prefill_request(1)
        await _drain(worker.Prefill(request, _Context()))  # warm: the store's clients open
        num_turns = await _cancel_at_every_turn(
            worker, lambda: worker.Prefill(request, _Context()), slow
        )
        assert num_turns > 0
    finally:
        await worker.engine.close()


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
async def test_decode_cancelled_at_every_turn_releases_everything(
    serving_cluster: LocalCluster, slow: bool
):
    prefill, decode = _worker("prefill", serving_cluster), _worker("decode", serving_cluster)
    try:
        request = _prefill_request(2)
        events = await _drain(prefill.Prefill(request, _Context()))
        handoff = events[-1].handoff
        decode_request = pb.DecodeRequest(handoff=handoff, sampling=request.sampling)
        finished = await _drain(decode.Decode(decode_request, _Context()))
        assert finished[-1].WhichOneof("event") == "finish", finished[-1]
        num_turns = await _cancel_at_every_turn(
            decode, lambda: decode.Decode(decode_request, _Context()), slow
        )
        assert num_turns > 0
    finally:
        await prefill.engine.close()
        await decode.engine.close()
