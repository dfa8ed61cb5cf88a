"""Request coalescing: per-key requests to one node become few batched RPCs.

A read asks 11 nodes for one shard each; with 32 reads in flight that would be 352 small RPCs,
and on a storage node every RPC costs far more CPU than moving its bytes. So per-key requests
to one node queue up here and go out as one batched RPC (``GetShards``/``PutShards`` take many
keys), with at most ``max_in_flight`` batches outstanding per node:

* while fewer batches are in flight, the queue is sent on the next event-loop turn, so a lone
  request waits for nothing (concurrency 1 sees no added latency);
* while the node is busy, requests accumulate and leave together when a batch returns, so batch
  size grows with load by itself (like Nagle's algorithm, without a timer).

::

    submit(k1) submit(k2) submit(k3)   (same loop turn, or while a batch is in flight)
         \\         |         /
          one RPC: keys [k1, k2, k3] -> results[0..2] resolve the three futures

A waiter may stop waiting (its read finished elsewhere): its future is cancelled. Cancelled
requests still queued are dropped; when every future of a batch in flight is cancelled, its RPC
is cancelled too, so a straggler's pending batches do not keep running for nobody (unless
``cancel_abandoned`` is False: then the batch keeps its in-flight slot until its reply comes,
for sends that cannot be called back, like a message on a stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from kvstore.errors import DeadlineExceeded

Item = TypeVar("Item")
Result = TypeVar("Result")


class Batcher(Generic[Item, Result]):
    """Queues items for one node and sends them as ``send(items, timeout_s) -> results``."""

    def __init__(
        self,
        send: Callable[[list[Item], float], Awaitable[Sequence[Result]]],
        max_items: int,
        max_bytes: int | None = None,
        max_in_flight: int = 2,
        *,
        cancel_abandoned: bool = True,
    ) -> None:
        self._send = send
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_in_flight = max_in_flight
        self.cancel_abandoned = cancel_abandoned
        # (item, its future, its bytes, its deadline on the loop's clock)
        self._queue: list[tuple[Item, asyncio.Future[Result], int, float]] = []
        self._num_in_flight = 0
        self._flush_handle: asyncio.Handle | None = None
        self.num_batches = 0
        self.num_items = 0

    def submit(self, item: Item, timeout_s: float, num_bytes: int = 0) -> asyncio.Future[Result]:
        """Queue ``item``; the future resolves to its result or the RPC's exception.

        ``timeout_s`` counts from now: time spent queued counts against it, and an item whose
        deadline passes while queued fails with DeadlineExceeded without being sent.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._queue.append((item, future, num_bytes, loop.time() + timeout_s))
        self._schedule()
        return future

    def _schedule(self) -> None:
        if self._flush_handle is None and self._num_in_flight < self.max_in_flight:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send queued items as batches while fewer than ``max_in_flight`` are outstanding."""
        self._flush_handle = None
        now_s = asyncio.get_running_loop().time()
        for _, future, _, deadline_s in self._queue:
            if deadline_s <= now_s and not future.done():
                future.set_exception(DeadlineExceeded("deadline passed while queued for a batch"))
                future.add_done_callback(_retrieve)
        self._queue = [entry for entry in self._queue if not entry[1].done()]
        while self._queue and self._num_in_flight < self.max_in_flight:
            batch = self._take_batch()
            self._num_in_flight += 1
            self.num_batches += 1
            self.num_items += len(batch)
            rpc = asyncio.ensure_future(self._run(batch))
            if self.cancel_abandoned:
                _cancel_when_abandoned(rpc, [future for _, future, _, _ in batch])

    def _take_batch(self) -> list[tuple[Item, asyncio.Future[Result], int, float]]:
        size, num_bytes = 0, 0
        for _, _, item_bytes, _ in self._queue:
            over_bytes = self.max_bytes is not None and num_bytes + item_bytes > self.max_bytes
            if size == self.max_items or (size and over_bytes):
                break
            size, num_bytes = size + 1, num_bytes + item_bytes
        batch, self._queue = self._queue[:size], self._queue[size:]
        return batch

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result], int, float]]) -> None:
        timeout_s = max(entry[3] for entry in batch) - asyncio.get_running_loop().time()
        try:
            results = await self._send([item for item, _, _, _ in batch], timeout_s)
        except asyncio.CancelledError:
            _settle(batch, None, asyncio.CancelledError())
            raise
        except Exception as exc:
            _settle(batch, None, exc)
        else:
            _settle(batch, results, None)
        finally:
            self._num_in_flight -= 1
            if self._queue:
                self._schedule()


def _settle(
    batch: list[tuple[Any, asyncio.Future[Any], int, float]],
    results: Sequence[Any] | None,
    error: BaseException | None,
) -> None:
    for position, (_, future, _, _) in enumerate(batch):
        if future.done():
            continue
        if error is None and results is not None:
            future.set_result(results[position])
        elif isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error)  # type: ignore[arg-type]
            future.add_done_callback(_retrieve)


def _cancel_when_abandoned(rpc: asyncio.Future[None], futures: list[asyncio.Future[Any]]) -> None:
    def on_done(_: asyncio.Future[Any]) -> None:
        if not rpc.done() and all(f.cancelled() for f in futures):
            rpc.cancel()

    for future in futures:
        future.add_done_callback(on_done)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: its waiter may have stopped waiting already."""
    if not future.cancelled():
        future.exception()
