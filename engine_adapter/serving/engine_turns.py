"""The worker's engine, one request at a time: a FIFO lock that a drain can empty, that no
cancellation can leak, and that notices when it stops moving.

::

    turn() --queue empty, engine free--> held (yields True) --exit, however--> next waiter
           --else--> queued (FIFO) --the holder leaves--> held
                                   --the worker drains--> yields False (nothing held)
                                   --cancelled--> out of the queue; a grant that came in
                                                  the same turn is passed on

Why not ``asyncio.Lock`` raced against the drain event in two tasks: a request cancelled in
the event-loop turn its lock task was granted left with the lock held, and every later
request of that worker waited forever (issue 42). Here the grant and its hand-back live in
the one coroutine that waits, and :meth:`turn` is the only way in, so an exit at any await
(error, timeout, cancellation, a drain) gives back what it holds.

A wedge shows itself: :meth:`stalled` names a holder that made no progress (a grant, a
release or :meth:`progress`) for longer than ``stall_after_s`` while the engine was held,
which turns the worker's Health to not-serving (``WorkerBase.not_serving``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from prometheus_client import Gauge


class EngineTurns:
    """The engine's lock and queue (see the module doc). One per worker, one event loop."""

    def __init__(self, waiting: Gauge, running: Gauge) -> None:
        """``waiting``/``running``: the gauges of requests queued for and holding the engine."""
        self._waiting, self._running = waiting, running
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self.held = False
        self.holder = ""  # the request id holding the engine ("" while free)
        self.last_progress_s = time.monotonic()
        self.closed = False  # set by close(): no request starts any more

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def turn(self, request_id: str) -> AsyncIterator[bool]:
        """Hold the engine inside; yields False (holding nothing) if the worker drains first."""
        with self._waiting.track_inprogress():
            granted = await self._wait()
        if not granted:
            yield False
            return
        self.holder = request_id
        try:
            with self._running.track_inprogress():
                yield True
        finally:
            self._release()

    def progress(self) -> None:
        """The holder moved (a token, a finished stage): it is not wedged."""
        self.last_progress_s = time.monotonic()

    def close(self) -> None:
        """Take no new turns: queued requests get False at once (the worker drains)."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)

    def stalled(self, stall_after_s: float, now_s: float | None = None) -> str:
        """Why the engine counts as wedged ("" if it does not)."""
        now_s = time.monotonic() if now_s is None else now_s
        idle_s = now_s - self.last_progress_s
        if not self.held or idle_s <= stall_after_s:
            return ""
        return (
            f"the engine has been held by request {self.holder or '?'} for {idle_s:.0f} s with "
            f"no progress ({self.num_waiting} requests queued behind it; the limit is "
            f"{stall_after_s:g} s)"
        )

    async def _wait(self) -> bool:
        if self.closed:
            return False
        if not self.held and not self._waiters:
            self._grant()
            return True
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            return await turn  # _release counts the engine as ours before it wakes us
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.result():
                self._release()  # granted in the turn we were cancelled: pass it on
            elif turn in self._waiters:
                self._waiters.remove(turn)
            raise

    def _grant(self) -> None:
        self.held = True
        self.progress()

    def _release(self) -> None:
        self.held, self.holder = False, ""
        self.progress()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._grant()
                waiter.set_result(True)
                return
