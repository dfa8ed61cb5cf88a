"""Faults while serving: killed and hung workers, storage nodes lost during a workload, and
clean shutdown of ``kvstore serve`` (no worker process survives it, even a SIGKILL of it).

Every request has a deadline, so a test that hangs is itself the bug; pytest-timeout turns
it into a failure. Waits for processes to start, stop or be seen are bounded in minutes (a
loaded machine is slow, not wrong); what a test asserts on time is only what separates the
behaviour under test from its failure (a death seen at once, not after a timeout).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.router import Router
from engine_adapter.serving.router_service import ServingClient
from engine_adapter.serving.worker_pool import WorkerPool
from kvstore.errors import Unavailable
from tests.engine_adapter.serving.conftest import (
    BLOCK_TOKENS,
    MODEL,
    STARTUP_TIMEOUT_S,
    is_gone,
    reference_generate,
    start_serve,
    started,
)

pytest.importorskip("torch")
# The first test of a run may also pay for the session's cluster and workers to start.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SLOW_MS = "4000"  # a worker slowed this much is surely mid-request when it is killed
WAIT_S = 120.0  # bound on waiting for a request, a process's exit or the router's view
# Silence on a decode stream the router tolerates here: far above WAIT_S, so a death it sees
# within WAIT_S was seen from the broken stream, not from the silence.
TOKEN_TIMEOUT_S = 600.0
# The hung worker's attempt deadline; far below the request's, which the worker must not hold.
PREFILL_ATTEMPT_S = 15.0
REQUEST_TIMEOUT_S = 300.0


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(num_tokens)]


async def _wait_busy(router: Router, worker_id: str, timeout_s: float = WAIT_S) -> None:
    """Wait until ``worker_id`` reports a request in progress (its Health says so)."""
    worker = next(w for w in router.endpoints if w.worker_id == worker_id)
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        reply = await worker.stub.Health(pb.HealthRequest(), timeout=2.0)
        if reply.num_active:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{worker_id} never started the request: routing picked another worker")


@pytest.mark.slow
async def test_prefill_worker_killed_mid_request_is_retried_on_the_other(
    worker_pool: WorkerPool, reference_engine
):
    prompt = _prompt(1, 2 * BLOCK_TOKENS + 9)
    expected = await reference_generate(reference_engine, prompt, 6)
    worker_pool.add("p2", "prefill", ["--inject-delay-ms", SLOW_MS])
    try:
        prefill = [worker_pool.workers["p2"].address, worker_pool.workers["p1"].address]
        router = Router(prefill, worker_pool.addresses("decode"), policy="round-robin")
        async with started(router):
            request = asyncio.create_task(
                router.generate(token_ids=prompt, tenant="faults", max_new_tokens=6)
            )
            await _wait_busy(router, "p2")
            worker_pool.kill("p2")
            completion = await asyncio.wait_for(request, WAIT_S)
    finally:
        worker_pool.remove("p2")
    assert completion.prefill_worker_id == "p1", "the request was not retried on p1"
    assert completion.num_prefill_attempts == 2
    assert completion.token_ids == expected, "the retried request generated other tokens"


@pytest.mark.slow
async def test_decode_worker_killed_fails_cleanly_then_recovers(worker_pool: WorkerPool):
    prompt = _prompt(2, 100)
    worker_pool.restart("d0", ["--inject-delay-ms", SLOW_MS])
    try:
        addresses = worker_pool.addresses("prefill"), worker_pool.addresses("decode")
        async with started(Router(*addresses, token_timeout_s=TOKEN_TIMEOUT_S)) as router:
            request = asyncio.create_task(
                router.generate(token_ids=prompt, tenant="faults", max_new_tokens=4)
            )
            await _wait_busy(router, "d0")
            worker_pool.kill("d0")
            start_s = time.monotonic()
            with pytest.raises(Unavailable, match="no healthy decode worker"):
                await asyncio.wait_for(request, WAIT_S)
            assert time.monotonic() - start_s < WAIT_S, "the router was slow to see d0 die"
            assert worker_pool.restart_dead() == ["d0"]  # what `kvstore serve` does each second
            worker_pool.wait_ready()
            d0 = next(w for w in router.endpoints if w.worker_id == "d0")
            deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
            while not d0.healthy:  # the router's probe (about every second) finds d0 again
                assert time.monotonic() < deadline_s, "the router never saw d0 come back"
                await asyncio.sleep(0.1)
            again = await router.generate(token_ids=prompt, tenant="faults", max_new_tokens=4)
    finally:
        if not worker_pool.workers["d0"].alive:
            worker_pool.restart("d0")
    assert again.decode_worker_id == "d0" and len(again.token_ids) == 4


@pytest.mark.slow
async def test_decode_worker_killed_mid_stream_resumes_on_another(
    worker_pool: WorkerPool, reference_engine
):
    """The router restarts decode on d0 from the same handoff, checks the tokens already
    streamed come out again, and streams the rest: the caller sees one clean sequence."""
    prompt = _prompt(5, 150)
    expected = await reference_generate(reference_engine, prompt, 8)
    worker_pool.add("d1", "decode", ["--inject-delay-ms", "700"])
    token_ids, finish = [], None
    try:
        decode = [worker_pool.workers["d1"].address, worker_pool.workers["d0"].address]
        router = Router(worker_pool.addresses("prefill"), decode, policy="round-robin")
        async with started(router):
            async for event in router.stream(token_ids=prompt, tenant="faults", max_new_tokens=8):
                if event.WhichOneof("event") == "token":
                    token_ids.append(event.token.token_id)
                    if len(token_ids) == 3:  # the first token and two from d1
                        worker_pool.kill("d1")
                elif event.WhichOneof("event") == "finish":
                    finish = event.finish
    finally:
        worker_pool.remove("d1")
    assert finish is not None and finish.decode_worker_id == "d0", "decode did not move to d0"
    assert token_ids == expected, "the resumed stream repeated, skipped or changed tokens"


@pytest.mark.slow
async def test_a_busy_decode_worker_is_waited_for_not_declared_dead(worker_pool: WorkerPool):
    """d0 stays silent far longer than the router's silence limit (each token takes 2 s, the
    limit is 0.3 s) but answers Health: the router waits, the request finishes on d0, and d0
    is never marked down (under a flood a decode worker with queued requests is busy, not
    dead)."""
    worker_pool.restart("d0", ["--inject-delay-ms", "2000"])
    try:
        addresses = worker_pool.addresses("prefill"), worker_pool.addresses("decode")
        router = Router(*addresses, token_timeout_s=0.3, prefill_attempt_timeout_s=0.3)
        async with started(router):
            completion = await router.generate(
                token_ids=_prompt(6, 70), tenant="busy", max_new_tokens=3
            )
            d0 = next(w for w in router.endpoints if w.worker_id == "d0")
            assert d0.healthy and d0.last_error == "", f"d0 was declared down: {d0.last_error}"
    finally:
        worker_pool.restart("d0")
    assert completion.decode_worker_id == "d0" and len(completion.token_ids) == 3


async def test_hung_prefill_worker_is_given_up_on(worker_pool: WorkerPool):
    prompt = _prompt(3, 80)
    addresses = worker_pool.addresses("prefill"), worker_pool.addresses("decode")
    router = Router(
        *addresses,
        policy="round-robin",
        prefill_attempt_timeout_s=PREFILL_ATTEMPT_S,
        timeout_s=REQUEST_TIMEOUT_S,
    )
    async with started(router):
        pid = worker_pool.workers["p0"].proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            start_s = time.monotonic()
            completion = await router.generate(token_ids=prompt, tenant="faults", max_new_tokens=3)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert completion.prefill_worker_id == "p1" and completion.num_prefill_attempts == 2
    assert time.monotonic() - start_s < REQUEST_TIMEOUT_S / 2, (
        "the hung worker held the request past its attempt deadline"
    )


async def test_storage_nodes_killed_during_workload_change_no_output(
    worker_pool: WorkerPool, serving_cluster, reference_engine
):
    """Nodes die one by one mid-workload: every output is unchanged. Up to 2 of 12 down,
    blocks still read (10 shards suffice); with 3 down the prefix misses and the decode
    worker recomputes the blocks it cannot read."""
    shared = _prompt(4, 2 * BLOCK_TOKENS)
    prompts = [shared + _prompt(10 + i, 40 + 30 * i) for i in range(6)]
    expected = [await reference_generate(reference_engine, p, 4) for p in prompts]
    index_to_killed = {2: "n03", 4: "n07", 5: "n11"}
    completions = []
    addresses = worker_pool.addresses("prefill"), worker_pool.addresses("decode")
    try:
        async with started(Router(*addresses)) as router:
            for index, prompt in enumerate(prompts):
                if index in index_to_killed:
                    serving_cluster.kill_node(index_to_killed[index])
                completions.append(
                    await router.generate(token_ids=prompt, tenant="nodes", max_new_tokens=4)
                )
    finally:
        for node_id in index_to_killed.values():
            if not serving_cluster.is_running(node_id):
                serving_cluster.restart_node(node_id)
    for index, (completion, tokens) in enumerate(zip(completions, expected, strict=True)):
        assert completion.token_ids == tokens, f"request {index} changed after nodes died"
    one_down, two_down, three_down = completions[2], completions[4], completions[5]
    for completion in (one_down, two_down):
        assert completion.num_cached_tokens == 2 * BLOCK_TOKENS, "a lost node lost the hits"
        assert completion.num_recomputed_tokens == 0, "blocks on 10+ nodes were not readable"
    assert three_down.num_cached_tokens == 0, "3 of 12 nodes down must read as a miss"
    num_full_tokens = len(prompts[5]) // BLOCK_TOKENS * BLOCK_TOKENS
    assert three_down.num_recomputed_tokens == num_full_tokens, (
        "the decode worker must recompute the blocks the store cannot return"
    )


def _wait_gone(pids: dict[str, int], timeout_s: float) -> list[str]:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s and not all(is_gone(p) for p in pids.values()):
        time.sleep(0.1)
    return [worker_id for worker_id, pid in pids.items() if not is_gone(pid)]


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
async def test_serve_stops_every_worker(serving_cluster, tmp_path, stop_signal):
    proc, ports, pids = start_serve(
        serving_cluster.cluster_toml, tmp_path, "--model", MODEL, "--grpc-port", "0"
    )
    try:
        assert sorted(pids) == ["d0", "p0"], f"expected workers p0 and d0, got {pids}"
        async with ServingClient(f"127.0.0.1:{ports['grpc']}") as client:
            completion = await client.generate(token_ids=[5] * 70, tenant="serve", max_new_tokens=3)
        assert len(completion.token_ids) == 3 and completion.ttft_s > 0
        proc.send_signal(stop_signal)
        proc.wait(WAIT_S)
        left = _wait_gone(pids, WAIT_S)
    finally:
        proc.kill()
        proc.wait()
        for pid in pids.values():
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived kvstore serve ({stop_signal.name}): orphans"
