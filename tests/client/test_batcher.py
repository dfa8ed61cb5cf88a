"""client/batcher.py: coalescing per-key requests into batched RPCs (with a fake RPC)."""

from __future__ import annotations

import asyncio

import pytest

from client.batcher import Batcher
from kvstore.errors import DeadlineExceeded


class FakeRpc:
    """Records batches; each call waits for ``release`` so tests control when replies come."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.num_cancelled = 0
        self.error: Exception | None = None

    async def __call__(self, items: list[str], timeout_s: float) -> list[str]:
        self.batches.append(list(items))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return [item.upper() for item in items]


async def test_requests_of_one_loop_turn_share_one_rpc() -> None:
    rpc = FakeRpc()
    batcher = Batcher(rpc, max_items=16)
    futures = [batcher.submit(k, 1.0) for k in "abc"]
    assert await asyncio.gather(*futures) == ["A", "B", "C"]
    assert rpc.batches == [["a", "b", "c"]], "three same-turn requests should be one RPC"


async def test_requests_accumulate_while_batches_are_in_flight() -> None:
    rpc = FakeRpc()
    rpc.release.clear()
    batcher = Batcher(rpc, max_items=16, max_in_flight=1)
    first = batcher.submit("a", 1.0)
    await asyncio.sleep(0)
    later = [batcher.submit(k, 1.0) for k in "bcd"]
    await asyncio.sleep(0.01)
    assert rpc.batches == [["a"]], "nothing new may go out while the node is busy"
    rpc.release.set()
    assert await first == "A" and await asyncio.gather(*later) == ["B", "C", "D"]
    assert rpc.batches == [["a"], ["b", "c", "d"]]


async def test_limits_split_batches() -> None:
    rpc = FakeRpc()
    by_items = Batcher(rpc, max_items=2, max_in_flight=8)
    await asyncio.gather(*(by_items.submit(k, 1.0) for k in "abcde"))
    assert rpc.batches == [["a", "b"], ["c", "d"], ["e"]]
    rpc.batches.clear()
    by_bytes = Batcher(rpc, max_items=100, max_bytes=10, max_in_flight=8)
    await asyncio.gather(*(by_bytes.submit(k, 1.0, num_bytes=4) for k in "abcd"))
    assert rpc.batches == [["a", "b"], ["c", "d"]], "a batch may not pass max_bytes"


async def test_an_rpc_error_reaches_every_waiter() -> None:
    rpc = FakeRpc()
    rpc.error = RuntimeError("node down")
    batcher = Batcher(rpc, max_items=16)
    futures = [batcher.submit(k, 1.0) for k in "ab"]
    for future in futures:
        with pytest.raises(RuntimeError, match="node down"):
            await future


async def test_abandoned_batches_are_cancelled_and_dropped() -> None:
    rpc = FakeRpc()
    rpc.release.clear()
    batcher = Batcher(rpc, max_items=16, max_in_flight=1)
    in_flight = [batcher.submit(k, 1.0) for k in "ab"]
    await asyncio.sleep(0)
    queued = batcher.submit("c", 1.0)
    for future in [*in_flight, queued]:
        future.cancel()
    await asyncio.sleep(0.01)
    assert rpc.num_cancelled == 1, "a batch nobody waits for should be cancelled"
    assert rpc.batches == [["a", "b"]], "a cancelled queued request must not be sent"
    rpc.release.set()
    assert await batcher.submit("d", 1.0) == "D", "the batcher must stay usable"


async def test_time_in_the_queue_counts_against_the_deadline() -> None:
    rpc = FakeRpc()
    rpc.release.clear()
    batcher = Batcher(rpc, max_items=16, max_in_flight=1)
    first = batcher.submit("a", 5.0)
    await asyncio.sleep(0)
    expires = batcher.submit("b", 0.01)
    await asyncio.sleep(0.05)
    rpc.release.set()
    assert await first == "A"
    with pytest.raises(DeadlineExceeded):
        await expires
    assert rpc.batches == [["a"]], "an item past its deadline must not be sent"
