"""A wedge shows itself (issue 42): a worker whose engine is held with no progress for longer
than its stall limit (``kvstore serve`` passes the request deadline) answers Health with
``not_serving`` and the reason, logs why, and the router sends it nothing (the front's
``/health`` is then 503, as ``Router.refusal`` answers); once the engine moves again it
serves again.

The wedge here is a real worker process whose requests sleep ``--inject-delay-ms`` while they
hold its engine (no token, no progress), with a stall limit far below that sleep.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.router import Router
from engine_adapter.serving.worker_base import WorkerBase
from engine_adapter.serving.worker_pool import WorkerPool
from kvstore.errors import Unavailable
from tests.engine_adapter.serving.conftest import STARTUP_TIMEOUT_S, started

pytest.importorskip("torch")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

HOLD_MS = 20_000  # the request holds the engine this long without progress...
STALL_S = 2.0  # ...far past this stall limit
WAIT_S = 120.0  # bound on the router's view changing (it probes about every second)


async def _until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, what
        await asyncio.sleep(0.1)


async def test_a_wedged_worker_says_so_and_the_router_sends_it_nothing(worker_pool: WorkerPool):
    args = ["--inject-delay-ms", str(HOLD_MS), "--stall-timeout-s", str(STALL_S)]
    worker_pool.add("p-wedge", "prefill", args)
    try:
        prefill = [worker_pool.workers["p-wedge"].address]
        router = Router(prefill, worker_pool.addresses("decode"), policy="round-robin")
        async with started(router):
            wedged = router.prefill.workers[0]
            assert router.refusal() is None
            request = asyncio.create_task(
                router.generate(token_ids=list(range(40)), tenant="wedge", max_new_tokens=2)
            )
            await _until(lambda: not wedged.healthy, "the router never took the wedged worker out")
            assert "not serving" in wedged.last_error and "no progress" in wedged.last_error
            reply = await wedged.stub.Health(pb.HealthRequest(), timeout=30)
            assert "no progress" in reply.not_serving, reply
            refusal = router.refusal()
            assert isinstance(refusal, Unavailable) and "not serving" in str(refusal), refusal
            with pytest.raises(Unavailable, match="not serving"):
                await router.generate(token_ids=[1, 2, 3], tenant="wedge", max_new_tokens=1)
            log = worker_pool.run_dir / "logs" / "p-wedge.log"
            await _until(lambda: "not serving" in log.read_text(), "the worker did not log it")
            # The held request ends (the engine moves): the worker serves again.
            completion = await asyncio.wait_for(request, STARTUP_TIMEOUT_S)
            assert completion.finish_reason == "length"
            await _until(lambda: wedged.healthy, "the router never took the worker back")
    finally:
        worker_pool.remove("p-wedge")


async def test_health_of_a_held_engine_turns_not_serving_and_back(caplog):
    """The same in one process, on the worker's own objects (no model needed)."""
    # No engine: nothing here touches it, only the engine's lock and the stall limit.
    worker = WorkerBase("w", None, None, stall_after_s=0.2)  # type: ignore[arg-type]
    watch = asyncio.create_task(worker.watch(interval_s=0.05))
    try:
        with caplog.at_level(logging.WARNING):
            async with worker.turns.turn("stuck"):
                await asyncio.sleep(0.6)
                assert "stuck" in worker.not_serving()
                await _until(lambda: "not serving" in caplog.text, "no log line", 30)
            assert worker.not_serving() == ""
            await _until(lambda: "serving again" in caplog.text, "no recovery line", 30)
    finally:
        watch.cancel()
