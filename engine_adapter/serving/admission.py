"""Admission: a bounded FIFO queue in front of a fixed number of pipeline slots.

::

    request --refusal()?--> 429 / 503 at once (queue full, or the wait would be too long)
            --> queue (FIFO, at most max_waiting_requests)
            --> slot (at most max_running_requests dispatched to the workers at once)
                prefill worker -> decode worker -> finish: the slot is free again
    a request still queued after max_queue_wait_s (or at its deadline) -> 429 queue_timeout

Why slots: a prefill worker and a decode worker each serve one request at a time, so
requests sent to them beyond a small backlog only wait there, out of sight: a decode
worker's queue is silent, its clients time out (504) and the router could not tell a busy
worker from a hung one. With a bounded number of dispatched requests the time a dispatched
request takes is bounded by a few requests' work, and every other request waits here, where
its wait is known, bounded and answered honestly (429 with ``Retry-After``), never a silent
504 at its deadline.

The wait estimate is Little's law over measured slot holding times: with ``S`` slots each
held ``H`` seconds on average (an exponentially weighted mean of recent requests), the
request at queue position ``p`` (``p`` requests ahead of it) starts after about
``(p + 1) * H / S`` seconds. Before any request finished the estimate is 0 (admit).
:class:`SlotTimes` is pure (the caller passes times in); :class:`AdmissionQueue` is its
asyncio shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine_adapter.serving.errors import QueueFull

DEFAULT_TIMEOUT_S = 120.0  # a request's deadline, arrival to last token
HOLD_EWMA_WEIGHT = 0.2  # weight of the newest holding time in the running mean
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 60


@dataclass(frozen=True)
class AdmissionConfig:
    """How many requests the router dispatches at once and how many may wait (0: no limit)."""

    max_running_requests: int = 0  # dispatched to the workers at once
    max_waiting_requests: int = 0  # queued for a slot
    max_queue_wait_s: float = 0.0  # longest wait for a slot (0: up to the request's deadline)

    def __post_init__(self) -> None:
        if min(self.max_running_requests, self.max_waiting_requests) < 0:
            raise ValueError("max_running_requests and max_waiting_requests must be >= 0")
        if not self.max_queue_wait_s >= 0:
            raise ValueError(f"max_queue_wait_s must be >= 0, got {self.max_queue_wait_s}")


class SlotTimes:
    """The running mean of how long a request holds its slot, and the wait it implies."""

    def __init__(self, weight: float = HOLD_EWMA_WEIGHT) -> None:
        self.weight = weight
        self.mean_hold_s = 0.0  # 0: nothing measured yet
        self.num_observed = 0

    def observe(self, hold_s: float) -> None:
        self.num_observed += 1
        if self.num_observed == 1:
            self.mean_hold_s = hold_s
        else:
            self.mean_hold_s += self.weight * (hold_s - self.mean_hold_s)

    def wait_s(self, num_ahead: int, num_slots: int) -> float:
        """Expected wait for a slot with ``num_ahead`` requests queued ahead (Little's law)."""
        if num_slots <= 0:
            return 0.0
        return (num_ahead + 1) * self.mean_hold_s / num_slots


def retry_after_s(wait_s: float) -> int:
    """A ``Retry-After`` value (whole seconds) for an expected wait."""
    return min(max(math.ceil(wait_s), MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


class AdmissionQueue:
    """The router's queue and slots (see the module doc). One per router, one event loop."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.times = SlotTimes()
        self.num_running = 0  # requests holding a slot
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def expected_wait_s(self) -> float:
        """How long a request arriving now would wait for a slot (0 if one is free)."""
        if self._has_free_slot() and not self._waiters:
            return 0.0
        return self.times.wait_s(self.num_waiting, self.config.max_running_requests)

    def refusal(self) -> QueueFull | None:
        """What a request arriving now would get instead of a place in the queue, or None."""
        config, wait_s = self.config, self.expected_wait_s()
        if config.max_waiting_requests and self.num_waiting >= config.max_waiting_requests:
            return QueueFull(
                f"{self.num_waiting} requests are queued for a worker (the limit is "
                f"{config.max_waiting_requests}); retry later",
                "queue_full",
                retry_after_s(wait_s),
            )
        if config.max_queue_wait_s and wait_s > config.max_queue_wait_s:
            return QueueFull(
                f"at the rate requests finish, this one would wait about {wait_s:.0f} s for a "
                f"worker (the queue allows {config.max_queue_wait_s:g} s); retry later",
                "queue_wait",
                retry_after_s(wait_s - config.max_queue_wait_s),
            )
        return None

    @contextlib.asynccontextmanager
    async def slot(self, deadline_s: float) -> AsyncIterator[None]:
        """Hold a slot while inside; QueueFull if none is free by the queue's wait limit or
        ``deadline_s`` (``time.monotonic()``), whichever comes first."""
        await self._acquire(deadline_s)
        start_s = time.monotonic()
        try:
            yield
        finally:
            self.times.observe(time.monotonic() - start_s)
            self._release()

    def _has_free_slot(self) -> bool:
        limit = self.config.max_running_requests
        return not limit or self.num_running < limit

    async def _acquire(self, deadline_s: float) -> None:
        if self._has_free_slot() and not self._waiters:
            self.num_running += 1
            return
        waited_from_s = time.monotonic()
        limit_s = deadline_s - waited_from_s
        if self.config.max_queue_wait_s:
            limit_s = min(limit_s, self.config.max_queue_wait_s)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            async with asyncio.timeout(max(limit_s, 0.0)):
                await turn  # _wake_next counts the slot as ours before it wakes us
        except BaseException as exc:
            if turn.done() and not turn.cancelled():  # given a slot just as we gave up
                self._release()
            elif turn in self._waiters:  # _wake_next drops a cancelled turn it meets first
                self._waiters.remove(turn)
            if isinstance(exc, TimeoutError):
                raise self._timed_out(time.monotonic() - waited_from_s) from None
            raise

    def _release(self) -> None:
        self.num_running -= 1
        self._wake_next()

    def _timed_out(self, waited_s: float) -> QueueFull:
        return QueueFull(
            f"waited {waited_s:.1f} s for a worker without getting one ({self.num_waiting} "
            "requests queued); retry later",
            "queue_timeout",
            retry_after_s(self.expected_wait_s()),
        )

    def _wake_next(self) -> None:
        """Give free slots to the longest-waiting requests."""
        while self._waiters and self._has_free_slot():
            turn = self._waiters.popleft()
            if not turn.done():
                self.num_running += 1
                turn.set_result(None)
