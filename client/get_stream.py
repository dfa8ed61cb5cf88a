"""One long-lived ``GetShardsStream`` to a node: batched get requests, replies matched in order.

A unary RPC costs both ends a call setup (headers, deadline timer, completion queue events);
a message on an open stream costs less. The node answers a stream's requests one at a time, in
order, so replies are matched to requests by position::

    get(req1) get(req2)  -> queue -> stream -> node
    futures [f1, f2]    <- reply1, reply2 (in order): f1 <- reply1, f2 <- reply2

A waiter that stops waiting (cancelled, or past its deadline) leaves its future in place: its
reply still arrives and is dropped, so later replies keep their positions. When the stream ends
for any reason, every request still waiting fails with :class:`StreamBroken` and the next get
opens a new stream; the caller decides whether to retry over unary ``GetShards``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from client.wire import ShardResultView
from kvstore.errors import Unavailable
from kvstore.proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)


class StreamBroken(Unavailable):
    """The stream ended before this request's reply came; ``code`` is the stream's status."""

    def __init__(self, message: str, code: grpc.StatusCode | None) -> None:
        super().__init__(message)
        self.code = code


class GetStream:
    """One GetShardsStream call; create inside the event loop, use while ``is_open``."""

    def __init__(self, open_call: Callable[[AsyncIterator[pb.GetShardsRequest]], Any]) -> None:
        self._requests: asyncio.Queue[pb.GetShardsRequest | None] = asyncio.Queue()
        self._waiting: collections.deque[asyncio.Future[list[ShardResultView]]] = (
            collections.deque()
        )
        self._call = open_call(self._request_iterator())
        self._reader = asyncio.ensure_future(self._read_replies())
        self.is_open = True

    def send(self, request: pb.GetShardsRequest) -> asyncio.Future[list[ShardResultView]]:
        """Queue ``request``; the future resolves to its reply's results, or StreamBroken."""
        future: asyncio.Future[list[ShardResultView]] = asyncio.get_running_loop().create_future()
        if not self.is_open:
            future.set_exception(StreamBroken("stream already closed", None))
            return future
        self._waiting.append(future)
        self._requests.put_nowait(request)
        return future

    async def _request_iterator(self) -> AsyncIterator[pb.GetShardsRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read_replies(self) -> None:
        code, details = None, "stream closed"
        try:
            async for results in self._call:
                if not self._waiting:
                    code, details = grpc.StatusCode.INTERNAL, "reply without a request"
                    break
                future = self._waiting.popleft()
                if not future.done():
                    future.set_result(results)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except asyncio.CancelledError:
            details = "stream cancelled"
        finally:
            self._end(code, details)

    def _end(self, code: grpc.StatusCode | None, details: str) -> None:
        """Mark the stream closed and fail every request still waiting for a reply."""
        self.is_open = False
        self._call.cancel()
        self._requests.put_nowait(None)
        name = code.name if code is not None else "closed"
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(StreamBroken(f"stream ended ({name}): {details}", code))
                future.add_done_callback(_retrieve)

    async def close(self) -> None:
        """End the stream; requests still waiting fail with StreamBroken."""
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        if self.is_open:  # cancelled before it started: its finally never ran
            self._end(None, "closed")


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: its waiter may have stopped waiting already."""
    if not future.cancelled():
        future.exception()
