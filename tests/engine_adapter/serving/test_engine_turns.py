"""The worker's engine lock (``engine_turns.py``): FIFO, emptied by a drain, never leaked by a
cancellation at any event-loop turn, and a holder that stops moving shows as a wedge."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Gauge

from engine_adapter.serving.engine_turns import EngineTurns

MAX_TURNS = 12  # past the last await of a turn() entered behind a holder


def _turns() -> EngineTurns:
    registry = CollectorRegistry()
    return EngineTurns(
        Gauge("waiting", "", registry=registry), Gauge("running", "", registry=registry)
    )


def _assert_free(turns: EngineTurns, what: str) -> None:
    assert not turns.held, f"{what}: the engine is still held (a leaked lock wedges the worker)"
    assert turns.num_waiting == 0, f"{what}: a cancelled request stayed in the queue"
    assert turns._waiting._value.get() == 0, f"{what}: the waiting gauge did not come back to 0"
    assert turns._running._value.get() == 0, f"{what}: the running gauge did not come back to 0"


async def _spin(num_turns: int) -> None:
    for _ in range(num_turns):
        await asyncio.sleep(0)


async def _hold(turns: EngineTurns, num_turns: int) -> None:
    async with turns.turn("holder"):
        await _spin(num_turns)


async def _use(turns: EngineTurns, entered: list[bool], request_id: str = "r") -> bool:
    async with turns.turn(request_id) as holds:
        entered.append(holds)
        await asyncio.sleep(0)
        return holds


async def test_cancel_at_every_turn_while_the_holder_leaves_never_leaks():
    """The issue-42 race: the waiter is granted the engine in the very turn it is cancelled.
    Every (release turn, cancel turn) pair in 0..MAX_TURNS is tried."""
    for release_at in range(MAX_TURNS):
        for cancel_at in range(MAX_TURNS):
            turns = _turns()
            holding = asyncio.create_task(_hold(turns, release_at))
            await asyncio.sleep(0)
            waiter = asyncio.create_task(_use(turns, []))
            await _spin(cancel_at)
            waiter.cancel()
            await asyncio.gather(waiter, holding, return_exceptions=True)
            _assert_free(turns, f"released at turn {release_at}, cancelled at {cancel_at}")
            # And the engine still serves: a fresh request gets it at once.
            assert await asyncio.wait_for(_use(turns, []), 5.0), "the next request got no turn"


async def test_cancel_at_every_turn_of_a_free_engine_never_leaks():
    for cancel_at in range(MAX_TURNS):
        turns = _turns()
        task = asyncio.create_task(_use(turns, []))
        await _spin(cancel_at)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        _assert_free(turns, f"cancelled at turn {cancel_at}")


async def test_an_error_inside_gives_the_engine_back():
    turns = _turns()
    with pytest.raises(ValueError):
        async with turns.turn("r"):
            raise ValueError("the request failed")
    _assert_free(turns, "after an error")


async def test_requests_get_the_engine_in_arrival_order():
    turns, order = _turns(), []

    async def request(name: str) -> None:
        async with turns.turn(name):
            order.append(name)
            await _spin(2)

    await asyncio.gather(*(request(str(i)) for i in range(5)))
    assert order == ["0", "1", "2", "3", "4"], "the engine's queue is not FIFO"
    _assert_free(turns, "after five requests")


async def test_a_drain_sends_queued_requests_away_at_once():
    turns, entered = _turns(), []
    release = asyncio.Event()

    async def holder() -> None:
        async with turns.turn("holder"):
            await release.wait()

    holding = asyncio.create_task(holder())
    await asyncio.sleep(0)
    queued = [asyncio.create_task(_use(turns, entered, str(i))) for i in range(3)]
    await _spin(3)
    turns.close()
    assert await asyncio.gather(*queued) == [False, False, False], "queued requests kept waiting"
    assert not await _use(turns, entered), "a request arriving after the drain got the engine"
    release.set()
    await holding
    _assert_free(turns, "after the drain")


async def test_a_holder_without_progress_is_reported_as_wedged():
    turns = _turns()
    async with turns.turn("req-7"):
        now_s = turns.last_progress_s
        assert turns.stalled(10.0, now_s + 5.0) == "", "a holder within its limit is not wedged"
        reason = turns.stalled(10.0, now_s + 11.0)
        assert "req-7" in reason and "no progress" in reason, reason
        turns.progress()
        assert turns.stalled(10.0, turns.last_progress_s + 5.0) == "", "progress clears it"
    assert turns.stalled(10.0, turns.last_progress_s + 1e6) == "", "a free engine is not wedged"
