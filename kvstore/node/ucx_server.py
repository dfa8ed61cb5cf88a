"""Node side of the UCX data path: send shard bytes from the memory that holds them.

A node's UCX worker listens for batch read requests (kvstore/wire/ucx_frames.py has the frames and
the exchange) and answers each with messages to the asking client's worker::

    client                                     node
    ------                                     ----
    expects the reply (tag_base) and payload
    i (tag_base + 1 + i), regions named later
    request(keys, worker_address, tag_base)
                          ----- UCX ------>    read the batch into staging, then
                                               UcxServer.post(worker_address, tag_base,
                                               [reply, payload 0, payload 1, ...]) sends
                          <---- UCX -------    message i with tag tag_base + i, straight from
    each payload received into its place,      the staging; over shared memory the client
    verify shard checksums, decode             pulls each payload with a CMA read; once it
                                               took every message the post's future is done
                                               and the staging is released

A MISS or a segment freed by expiry is reported in the reply and nothing is sent for it; the
node keeps what it sends from alive until the post's future is done. Endpoints to clients
are made from the client's worker address in the request and cached; an endpoint whose send
fails or times out (client gone, or it gave up on us) is dropped, and the next request from
that address makes a new one. If :meth:`UcxServer.post` raises (malformed or unreachable
address) the node cannot answer; the client times out and reads over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.shard_reader import BatchRead
from kvstore.wire import ucx_frames
from kvstore.wire.ucx_worker import UcxWorker, batch_tag

logger = logging.getLogger(__name__)

# How long a node keeps a posted payload for a client that does not take it.
UCX_SEND_TIMEOUT_S = 30.0
UNREACHABLE_RETRY_S = 60.0  # a client UCX cannot reach is answered inline this long


class UcxServer:
    """A node's UCX sender: one worker, endpoints cached per client worker address."""

    def __init__(
        self,
        worker: UcxWorker | None = None,
        *,
        transports: str | None = None,
        max_endpoints: int = 256,
    ) -> None:
        if max_endpoints < 1:
            raise InvalidArgument(f"max_endpoints must be >= 1, got {max_endpoints}")
        self.worker = worker if worker is not None else UcxWorker(transports)
        self._max_endpoints = max_endpoints
        self._endpoints: OrderedDict[bytes, Any] = OrderedDict()
        self._unreachable: OrderedDict[bytes, float] = OrderedDict()  # address -> retry time
        # Also at interpreter exit if close() was never awaited (see _drop for why).
        weakref.finalize(self, _close_endpoints, self._endpoints)

    @property
    def address(self) -> bytes:
        """This node's UCX worker address: advertise it to clients over gRPC."""
        return self.worker.address

    @property
    def num_endpoints(self) -> int:
        return len(self._endpoints)

    def post(
        self,
        client_address: bytes,
        tag_base: int,
        buffers: Sequence[Any],
        timeout_s: float,
    ) -> asyncio.Future[bool]:
        """Start sending ``buffers[i]`` with tag ``tag_base + i`` (None entries are skipped).

        Raises at once (InvalidArgument for a malformed address or tag base, Unavailable if
        the client's worker cannot be reached): the node then answers inline over gRPC.
        Otherwise returns a future that turns True once the client has taken every message,
        or False if a send failed or ``timeout_s`` passed (the client is gone or gave up; its
        endpoint is dropped). The buffers are read in place: keep them alive and unchanged
        (their segment pinned) until the future is done.
        """
        tags = [batch_tag(tag_base, i) for i in range(len(buffers))]
        endpoint = self._endpoint(client_address)
        futures: list[asyncio.Future[None]] = []
        try:
            for tag, buf in zip(tags, buffers, strict=True):
                if buf is not None:
                    futures.append(self.worker.send(endpoint, tag, buf))
        except Exception:
            self._give_up(client_address, futures)
            raise
        return self._outcome(client_address, futures, timeout_s)

    async def send(
        self,
        client_address: bytes,
        tag_base: int,
        buffers: Sequence[Any],
        timeout_s: float,
    ) -> bool:
        """:meth:`post`, then wait for its outcome."""
        return await self.post(client_address, tag_base, buffers, timeout_s)

    def _outcome(
        self, client_address: bytes, futures: list[asyncio.Future[None]], timeout_s: float
    ) -> asyncio.Future[bool]:
        """True once every send completed; False at the first failure or at the timeout.

        Callbacks and one timer rather than a task per request: a node posts one of these
        per read, and tasks, gather and wait_for cost more CPU than the sends themselves.
        """
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[bool] = loop.create_future()
        pending = set(futures)

        def settle(ok: bool) -> None:
            if outcome.done():
                return
            timer.cancel()
            if not ok:
                logger.warning("UCX send of %d messages failed or timed out", len(futures))
                self._give_up(client_address, futures)
            outcome.set_result(ok)

        def on_done(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is not None:
                settle(False)
                return
            pending.discard(future)
            if not pending:
                settle(True)

        timer = loop.call_later(timeout_s, settle, False)
        for future in futures:
            future.add_done_callback(on_done)
        if not futures:
            settle(True)
        return outcome

    def _give_up(self, client_address: bytes, futures: list[asyncio.Future[None]]) -> None:
        for future in futures:
            future.cancel()  # stop tracking sends the client will never take
        self._drop(client_address)

    async def close(self) -> None:
        """Drop every endpoint and close the worker."""
        for address in list(self._endpoints):
            self._drop(address)
        await self.worker.close()

    def _endpoint(self, address: bytes) -> Any:
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            self._endpoints.move_to_end(address)
            return endpoint
        self._check_reachable(address)
        try:
            endpoint = self.worker.connect(address)
        except Unavailable:
            self._unreachable[address] = time.monotonic() + UNREACHABLE_RETRY_S
            if len(self._unreachable) > self._max_endpoints:
                self._unreachable.popitem(last=False)
            raise
        self._endpoints[address] = endpoint
        if len(self._endpoints) > self._max_endpoints:
            self._drop(next(iter(self._endpoints)))
        return endpoint

    def _check_reachable(self, address: bytes) -> None:
        """Fail fast for a client UCX could not reach recently (UCX logs each failed try)."""
        retry_s = self._unreachable.get(address)
        if retry_s is None:
            return
        if time.monotonic() < retry_s:
            raise Unavailable("client's UCX worker was unreachable moments ago; answer inline")
        del self._unreachable[address]

    def _drop(self, address: bytes) -> None:
        """Close and forget an endpoint without waiting for the peer.

        Start the close ourselves: an endpoint destroyed unclosed makes ucxx flush it in its
        destructor, which over TCP blocks until the peer progresses, forever if it is gone.
        """
        endpoint = self._endpoints.pop(address, None)
        if endpoint is not None:
            endpoint.close()


def _close_endpoints(endpoints: OrderedDict[bytes, Any]) -> None:
    while endpoints:
        endpoints.popitem()[1].close()


def answer(
    server: UcxServer, delivery: pb.UcxDelivery, read: BatchRead, key: bytes
) -> asyncio.Future[bool]:
    """Post the reply frame (the table, signed with the session's ``key``), then each HIT
    payload as a message of its own.

    Raises InvalidArgument or Unavailable if the client's worker cannot be reached; the
    client then times out and reads over gRPC. The payloads are read in place from the
    staging: keep ``read`` until the returned future is done, then release it.
    """
    reply = ucx_frames.encode_reply(read.entries, key, delivery.tag_base)
    stream, payloads, start = read.payloads, [], 0
    for entry in read.entries:
        if entry.payload_bytes:
            payloads.append(stream[start : start + entry.payload_bytes])
            start += entry.payload_bytes
    return server.post(
        delivery.worker_address, delivery.tag_base, [reply, *payloads], UCX_SEND_TIMEOUT_S
    )


def refuse(
    server: UcxServer,
    delivery: pb.UcxDelivery,
    error: KVStoreError,
    key: bytes | None,
    *,
    legacy: bool = False,
) -> None:
    """Send the reply frame that refuses a request, signed with the session's ``key`` (None:
    the node does not know the session; ``legacy``: in an earlier release's format, for its
    clients); nothing if the client is unreachable."""
    if legacy:
        frame = ucx_frames.encode_legacy_refusal(error)
    else:
        frame = ucx_frames.encode_error(error, key, delivery.tag_base)
    try:
        server.post(delivery.worker_address, delivery.tag_base, [frame], UCX_SEND_TIMEOUT_S)
    except (InvalidArgument, Unavailable) as exc:
        logger.debug("cannot refuse a UCX request: the client is unreachable: %s", exc)
