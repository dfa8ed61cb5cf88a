"""One storage node as the client sees it: a reused gRPC channel, its calls and its health.

Every RPC to a node goes through :meth:`NodeConn.call` (unary) or :meth:`NodeConn.read_batch`
(the ``ReadBatch`` stream), which attach the bearer token, turn a failed RPC into the
kvstore.errors exception for its status code (one mapping, in kvstore/errors.py) and keep
:class:`client.node_health.NodeHealth` up to date.

A NodeConn is also the gRPC *read transport* of its node: ``read_batch`` asks for one batch of
keys and lands the answer's payloads in the caller's blocks as its chunks arrive
(client/landing.py). client/ucx/reader.py has the UCX read transport, which falls back to this
one. Writes are one ``PutShards`` per node per batch (:meth:`NodeConn.put_shards`), encoded
here with one copy of each shard.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from client.landing import NodeAnswer, StreamLander, Wanted
from client.node_health import NodeHealth
from client.wire import parse_get_shards_reply
from kvstore.config import NodeConfig
from kvstore.errors import RETRYABLE, BadReply, KVStoreError, Overloaded
from kvstore.grpc_errors import from_grpc_status
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import aio_channel
from kvstore.wire import batch_answer
from kvstore.wire.put_request import encode_put_request

CHANNEL_OPTIONS = (
    # Blocks are up to 16 MiB and batches larger; the node enforces its own request limit.
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # gRPC's default reconnect backoff grows to 120 s; a restarted node should be found fast.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # gRPC also takes this as the time a connection attempt may take: at 100 ms, TLS
    # handshakes on a loaded machine were cut short ("tcp handshaker shutdown") and calls
    # failed as UNAVAILABLE. A refused connection (a node down) still fails at once.
    ("grpc.min_reconnect_backoff_ms", 5000),
)

REDIAL_EVERY_S = 0.05  # a failed channel is dialed afresh at most this often
HEALTH_REUSE_S = 0.5  # a Health reply this recent serves another read transport's ask
REDIAL_GRACE_S = 10.0  # calls in flight on a replaced channel get this long to finish
FIRST_BACKOFF_S = 0.01  # a put's first retry; then x4, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 0.16
# How long a put keeps retrying a node that fails (within its deadline): long enough for a
# node that serves again to be dialed, short enough that puts with 3 nodes of a group truly
# down fail in seconds, not at the deadline.
RETRY_WINDOW_S = 2.0

# Status codes that say "this node is down or broken" (not "your request is wrong").
_NODE_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


class NodeReader(Protocol):
    """A node's read transport: one request for a batch of keys, its answer landed."""

    node_id: str

    async def read_batch(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        timeout_s: float,
    ) -> NodeAnswer: ...


class NodeConn:
    """Channel, stub and health of one node for one tenant; create inside the event loop."""

    def __init__(
        self,
        node: NodeConfig,
        tenant: str,
        token: str | None,
        k: int,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.node_id = node.id
        self.address = node.address
        self.tenant = tenant
        self.token = token
        self.k = k
        self.max_batch_bytes = node.max_batch_bytes
        self._credentials = credentials
        self._open_channel()
        self.health = NodeHealth()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._redialed_at_s = -math.inf
        self._closing: set[asyncio.Task[None]] = set()  # replaced channels, closing
        self.num_redials = 0
        self._health_reply: tuple[float, pb.HealthReply] | None = None  # (when, reply)

    def _open_channel(self) -> None:
        # TLS when the cluster has it on (kvstore/tls.py); plaintext only on loopback. The
        # server must hold node ``self.node_id``'s certificate, or no call (and no token) goes
        # out.
        self.channel = aio_channel(
            self.address, self._credentials, CHANNEL_OPTIONS, node_id=self.node_id
        )
        self.stub = ShardStoreStub(self.channel)
        # GetShards replies carry the shards: parse them without protobuf's copies.
        self.stub.GetShards = self.channel.unary_unary(
            "/kvstore.v1.ShardStore/GetShards",
            request_serializer=pb.GetShardsRequest.SerializeToString,
            response_deserializer=parse_get_shards_reply,
        )
        # Batch reads and writes travel as bytes we encode and decode ourselves.
        self._read_batch = self.channel.unary_stream("/kvstore.v1.ShardStore/ReadBatch")
        self._put_shards = self.channel.unary_unary(
            "/kvstore.v1.ShardStore/PutShards",
            response_deserializer=pb.PutShardsReply.FromString,
        )

    def redial(self, *, force: bool = False) -> bool:
        """Dial the node now on a fresh channel if this one failed to connect (or ``force``);
        True if it did.

        A channel whose connection attempt failed waits out gRPC's reconnect backoff (up to
        ``grpc.max_reconnect_backoff_ms``) and fails every call meanwhile, even once the node
        serves again. A node's return is an event (a map change, a put
        that needs it): a fresh channel connects at once. At most one redial per
        ``REDIAL_EVERY_S`` unless forced, so the puts waiting on a dead node share them.
        """
        now_s = time.monotonic()
        failed = self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE
        if not force and (not failed or now_s - self._redialed_at_s < REDIAL_EVERY_S):
            return False
        self._redialed_at_s = now_s
        old = self.channel
        self._open_channel()
        self.num_redials += 1
        # Calls in flight on the old channel finish (or fail) on it; then it closes.
        task = asyncio.ensure_future(old.close(grace=REDIAL_GRACE_S))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return True

    async def read_batch(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        timeout_s: float,
    ) -> NodeAnswer:
        """One ReadBatch call for ``keys``; payloads land in ``outs`` as chunks arrive.

        Cancelling it cancels the call; nothing is written into ``outs`` afterwards (the
        chunks are copied here, on the event loop).
        """
        request = pb.GetShardsRequest(tenant=self.tenant, keys=keys).SerializeToString()
        lander = StreamLander(wanted, outs, self.k)
        try:
            call = self._read_batch(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
            async for chunk in call:
                lander.feed(batch_answer.chunk_data(chunk))
            answer = lander.finish()
        except grpc.aio.AioRpcError as exc:
            raise self._failed("ReadBatch", exc) from None
        except ValueError as exc:
            raise BadReply(f"node {self.node_id} sent a malformed batch answer: {exc}") from None
        self.health.record_success()
        return answer

    async def put_shards(
        self,
        traffic_class: str,
        items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]],
        timeout_s: float,
        written_at_s: float = 0.0,
    ) -> int:
        """Store ``(key, shard pieces)`` pairs on this node in one PutShards; new shards."""
        return await self.put_encoded(
            encode_put_request(self.tenant, traffic_class, items, written_at_s), timeout_s
        )

    async def put_encoded(self, request: bytes, timeout_s: float) -> int:
        """Send one PutShards request already encoded (:func:`encode_put_request`)."""
        reply = await self._call(self._put_shards, "PutShards", request, timeout_s)
        return int(reply.num_stored)

    async def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """Run one unary RPC (``method`` names a ShardStore RPC); raise KVStoreError on failure."""
        return await self._call(getattr(self.stub, method), method, request, timeout_s)

    async def recent_health(self, timeout_s: float) -> pb.HealthReply:
        """The node's Health reply, asked now unless one came in the last
        ``HEALTH_REUSE_S``: at connect, "auto" asks it once for every read transport that
        learns from it (stream, UCX, local), not once per transport."""
        now_s = time.monotonic()
        if self._health_reply is not None and now_s - self._health_reply[0] < HEALTH_REUSE_S:
            return self._health_reply[1]
        reply = await self.call("Health", pb.HealthRequest(), timeout_s)
        self._health_reply = (time.monotonic(), reply)
        return reply

    async def _call(self, stub: Any, method: str, request: Any, timeout_s: float) -> Any:
        try:
            reply = await stub(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(method, exc) from None
        self.health.record_success()
        return reply

    async def put_until(
        self, request: bytes, deadline_s: float, counters: Any, wanted: Callable[[], bool]
    ) -> None:
        """One encoded PutShards, retried on transient errors while ``wanted()`` and before
        ``deadline_s``: after a failure to reach the node, each retry dials it afresh
        (:meth:`redial`), so a node that comes back takes the put at once.

        ``counters.num_put_retries`` counts the retries."""
        backoff_s = FIRST_BACKOFF_S
        give_up_s = min(deadline_s, time.monotonic() + RETRY_WINDOW_S)
        while True:
            try:
                await self.put_encoded(request, deadline_s - time.monotonic())
                return
            except KVStoreError as exc:
                if not isinstance(exc, RETRYABLE) or not wanted():
                    raise
                if time.monotonic() + backoff_s >= give_up_s:
                    raise
            counters.num_put_retries += 1
            await asyncio.sleep(backoff_s)
            backoff_s = min(MAX_BACKOFF_S, 4 * backoff_s)
            self.redial()

    def _failed(self, method: str, exc: grpc.aio.AioRpcError) -> KVStoreError:
        error = from_grpc_status(exc.code(), f"node {self.node_id} {method}: {exc.details()}")
        if isinstance(error, Overloaded):
            self.health.record_overload(time.monotonic())
        elif exc.code() in _NODE_FAULT_CODES:
            self.health.record_failure(time.monotonic())
        return error

    def is_suspect(self) -> bool:
        return self.health.is_suspect(time.monotonic())

    async def close(self) -> None:
        await self.channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


T = TypeVar("T")


class BackgroundTasks:
    """Work a read transport starts on the side (Health asks, closing an old link): kept
    referenced while it runs, cancelled and awaited by :meth:`cancel_all`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def start(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def finish_despite_cancel(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile (it may be
    writing into the caller's buffers); then raise the cancel, else return its result."""
    future = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if future.cancelled():
                raise
            cancelled = exc
        except Exception:  # the future holds it: result() below raises it
            pass
    if cancelled is not None:
        raise cancelled
    return future.result()


def consume_result(task: asyncio.Future[Any]) -> None:
    """Done-callback for RPC tasks nobody awaits any more: retrieve their exception."""
    if not task.cancelled():
        task.exception()
