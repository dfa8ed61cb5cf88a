"""The router's admission queue: slots, FIFO order, refusals and their Retry-After.

Pure asyncio (no workers): slots are held and released by the test itself, so each test
waits on conditions; the only timed wait is a queue-wait limit the test sets itself and
checks only from below (never "it was fast enough").
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine_adapter.serving.admission import (
    AdmissionConfig,
    AdmissionQueue,
    SlotTimes,
    retry_after_s,
)
from engine_adapter.serving.errors import QueueFull

FAR_S = 3600.0  # a deadline that never passes in a test


def _deadline(seconds: float = FAR_S) -> float:
    return time.monotonic() + seconds


def test_slot_times_follow_littles_law():
    times = SlotTimes(weight=0.5)
    assert times.wait_s(5, 2) == 0.0, "nothing measured: no wait predicted (admit)"
    times.observe(4.0)
    assert times.mean_hold_s == 4.0
    times.observe(2.0)
    assert times.mean_hold_s == 3.0
    # 3 requests ahead, 2 slots each freed every 3 s: the 4th free slot comes after 6 s.
    assert times.wait_s(3, 2) == pytest.approx(6.0)
    assert retry_after_s(0.2) == 1 and retry_after_s(7.1) == 8 and retry_after_s(1e9) == 60


def test_config_is_validated():
    with pytest.raises(ValueError):
        AdmissionConfig(max_running_requests=-1)
    with pytest.raises(ValueError):
        AdmissionConfig(max_queue_wait_s=float("nan"))


async def test_requests_wait_in_arrival_order_for_free_slots():
    queue = AdmissionQueue(AdmissionConfig(max_running_requests=2))
    order: list[int] = []
    release = [asyncio.Event() for _ in range(5)]

    async def request(index: int) -> None:
        async with queue.slot(_deadline()):
            order.append(index)
            await release[index].wait()

    tasks = []
    for index in range(5):
        tasks.append(asyncio.create_task(request(index)))
        await asyncio.sleep(0)  # arrive in this order
    while len(order) < 2:
        await asyncio.sleep(0)
    assert order == [0, 1] and queue.num_running == 2 and queue.num_waiting == 3
    num_entered = 2
    for index in (1, 0, 2, 3, 4):  # each release lets the longest waiter in
        release[index].set()
        num_entered = min(num_entered + 1, 5)
        while len(order) < num_entered:
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4], "a later request overtook an earlier one"
    assert queue.num_running == 0 and queue.num_waiting == 0
    assert queue.times.num_observed == 5


async def test_full_queue_and_long_waits_are_refused_at_once():
    queue = AdmissionQueue(
        AdmissionConfig(max_running_requests=1, max_waiting_requests=2, max_queue_wait_s=10.0)
    )
    hold = asyncio.Event()

    async def holder() -> None:
        async with queue.slot(_deadline()):
            await hold.wait()

    running = asyncio.create_task(holder())
    waiters = [asyncio.create_task(holder()) for _ in range(2)]
    while queue.num_waiting < 2:
        await asyncio.sleep(0)
    refusal = queue.refusal()
    assert isinstance(refusal, QueueFull) and refusal.code == "queue_full"
    hold.set()
    await asyncio.gather(running, *waiters)
    assert queue.refusal() is None, "an empty queue refused a request"
    queue.times.mean_hold_s = 8.0  # each request holds the one slot 8 s
    hold.clear()
    running = asyncio.create_task(holder())
    waiter = asyncio.create_task(holder())
    while queue.num_waiting < 1:
        await asyncio.sleep(0)
    refusal = queue.refusal()  # 1 ahead, one slot, 8 s each: 16 s > 10 s allowed
    assert isinstance(refusal, QueueFull) and refusal.code == "queue_wait"
    assert refusal.retry_after_s == 6, "Retry-After should be the wait beyond the limit"
    hold.set()
    await asyncio.gather(running, waiter)


async def test_a_request_waits_no_longer_than_the_queue_allows():
    limit_s = 0.3
    queue = AdmissionQueue(AdmissionConfig(max_running_requests=1, max_queue_wait_s=limit_s))
    hold = asyncio.Event()

    async def holder() -> None:
        async with queue.slot(_deadline()):
            await hold.wait()

    running = asyncio.create_task(holder())
    while queue.num_running < 1:
        await asyncio.sleep(0)
    start_s = time.monotonic()
    with pytest.raises(QueueFull) as refused:
        async with queue.slot(_deadline()):
            pass
    assert refused.value.code == "queue_timeout"
    assert time.monotonic() - start_s >= limit_s * 0.9
    assert queue.num_waiting == 0, "a timed-out request stayed in the queue"
    with pytest.raises(QueueFull):  # the request's own deadline bounds the wait too
        async with queue.slot(_deadline(0.05)):
            pass
    hold.set()
    await running
    assert queue.num_running == 0


async def test_cancelled_waiters_leave_and_free_slots_go_to_the_next():
    queue = AdmissionQueue(AdmissionConfig(max_running_requests=1))
    hold, entered = asyncio.Event(), asyncio.Event()

    async def holder(signal: asyncio.Event | None = None) -> None:
        async with queue.slot(_deadline()):
            if signal is not None:
                signal.set()
            await hold.wait()

    running = asyncio.create_task(holder())
    leaving = asyncio.create_task(holder())
    staying = asyncio.create_task(holder(entered))
    while queue.num_waiting < 2:
        await asyncio.sleep(0)
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    assert queue.num_waiting == 1
    hold.set()
    await asyncio.wait_for(entered.wait(), 60)
    await asyncio.gather(running, staying)
    assert queue.num_running == 0 and queue.num_waiting == 0


async def test_no_limits_admit_everything_at_once():
    queue = AdmissionQueue()
    async with queue.slot(_deadline()), queue.slot(_deadline()):
        assert queue.num_running == 2 and queue.refusal() is None


async def _hold_slot(queue: AdmissionQueue, num_turns: int) -> None:
    async with queue.slot(_deadline()):
        for _ in range(num_turns):
            await asyncio.sleep(0)


async def test_cancel_at_every_turn_while_a_slot_frees_never_leaks():
    """A waiter cancelled in any turn around the release of the slot it waits for (issue 42:
    the queue once raised ValueError there, a 500 instead of the cancellation)."""
    for release_at in range(8):
        for cancel_at in range(8):
            queue = AdmissionQueue(AdmissionConfig(max_running_requests=1))

            holder = asyncio.create_task(_hold_slot(queue, release_at))
            await asyncio.sleep(0)
            waiter = asyncio.create_task(_hold_slot(queue, 1))
            for _ in range(cancel_at):
                await asyncio.sleep(0)
            waiter.cancel()
            results = await asyncio.gather(waiter, holder, return_exceptions=True)
            assert not isinstance(results[0], ValueError), results[0]
            what = f"released at turn {release_at}, cancelled at {cancel_at}"
            assert queue.num_running == 0 and queue.num_waiting == 0, what
