"""One storage node as the client sees it: a reused gRPC channel, its stub and its health.

Every RPC to a node goes through :meth:`NodeConn.call`, which attaches the bearer token, turns
a failed RPC into the kvstore.errors exception for its status code (one mapping, in
kvstore/errors.py) and keeps :class:`client.node_health.NodeHealth` up to date. Per-key shard
reads and writes go through :meth:`NodeConn.get_shard` and :meth:`NodeConn.put_shard`, which
coalesce the requests of one event-loop turn into one batched RPC (client/batcher.py).

Batched gets travel as messages on one long-lived ``GetShardsStream`` per node
(client/get_stream.py): a stream message costs both ends less CPU than a unary call. If the
stream breaks, the requests it still owed are sent again as unary ``GetShards`` within their
deadline (so a request's own error, say INVALID_ARGUMENT, reaches only that request), and the
next batch opens a new stream; a node without the streaming RPC gets unary calls from then on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from client.batcher import Batcher
from client.get_stream import GetStream, StreamBroken
from client.node_health import NodeHealth
from client.ucx_gets import PayloadLanding, UcxGets
from client.wire import ShardResultView, parse_get_shards_reply
from kvstore.config import NodeConfig
from kvstore.errors import BadReply, DeadlineExceeded
from kvstore.grpc_errors import from_grpc_status
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import aio_channel

log = logging.getLogger(__name__)

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

# Status codes that say "this node is down or broken" (not "your request is wrong").
_NODE_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


# Keys per batched GetShards: bounds the reply (16 x a 1.7 MB shard of a 16 MiB block).
MAX_GET_BATCH_KEYS = 16
MAX_PUT_BATCH_SHARDS = 64


class NodeConn:
    """Channel, stub and health of one node for one tenant; create inside the event loop."""

    def __init__(
        self,
        node: NodeConfig,
        tenant: str,
        token: str | None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.node_id = node.id
        self.address = node.address
        self.tenant = tenant
        self.token = token
        # TLS when the cluster has it on (kvstore/tls.py); plaintext only on loopback.
        self.channel = aio_channel(node.address, credentials, CHANNEL_OPTIONS)
        self.stub = ShardStoreStub(self.channel)
        # GetShards replies carry the shards: parse them without protobuf's copies.
        self.stub.GetShards = self.channel.unary_unary(
            "/kvstore.v1.ShardStore/GetShards",
            request_serializer=pb.GetShardsRequest.SerializeToString,
            response_deserializer=parse_get_shards_reply,
        )
        self._open_get_stream = self.channel.stream_stream(
            "/kvstore.v1.ShardStore/GetShardsStream",
            request_serializer=pb.GetShardsRequest.SerializeToString,
            response_deserializer=parse_get_shards_reply,
        )
        self._get_stream: GetStream | None = None
        self.use_get_stream = True
        self.health = NodeHealth()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._max_put_batch_bytes = node.max_batch_bytes // 2
        # An abandoned batch keeps its slot until its stream reply comes: the node answers a
        # stream in order, so sending more behind it would only queue there (a straggler's
        # queue stays here instead, where cancelled requests are dropped unsent).
        self._get_batcher: Batcher[tuple[bytes, PayloadLanding | None], ShardResultView] = Batcher(
            self._get_batch, MAX_GET_BATCH_KEYS, cancel_abandoned=False
        )
        self._class_to_put_batcher: dict[str, Batcher[tuple[bytes, bytes], None]] = {}
        # Set by KVClient when reads may take UCX (client/ucx_gets.py); None = gRPC only.
        self.ucx: UcxGets | None = None

    def get_shard(
        self, key: bytes, timeout_s: float, landing: PayloadLanding | None = None
    ) -> asyncio.Future[ShardResultView]:
        """Future of this node's ShardResultView for ``key`` (batched with concurrent gets).

        Over UCX the shard's payload lands in ``landing`` when one is given (get_into's
        buffer, client/ucx_gets.py); over gRPC it is ignored.
        """
        return self._get_batcher.submit((key, landing), timeout_s)

    def put_shard(
        self, key: bytes, shard: bytes, traffic_class: str, timeout_s: float
    ) -> asyncio.Future[None]:
        """Future that resolves once the node stored ``shard`` (batched per traffic class)."""
        batcher = self._class_to_put_batcher.get(traffic_class)
        if batcher is None:

            async def send(items: list[tuple[bytes, bytes]], timeout_s: float) -> list[None]:
                return await self._put_batch(traffic_class, items, timeout_s)

            batcher = Batcher(send, MAX_PUT_BATCH_SHARDS, self._max_put_batch_bytes)
            self._class_to_put_batcher[traffic_class] = batcher
        return batcher.submit((key, shard), timeout_s, num_bytes=len(shard))

    async def _get_batch(
        self, items: list[tuple[bytes, PayloadLanding | None]], timeout_s: float
    ) -> list[ShardResultView]:
        keys = [key for key, _ in items]
        if self.ucx is not None and self.ucx.reachable(self):
            landings = [landing for _, landing in items]
            return await self.ucx.get_batch(self, keys, landings, timeout_s)
        return await self.send_get(pb.GetShardsRequest(tenant=self.tenant, keys=keys), timeout_s)

    async def send_get(
        self, request: pb.GetShardsRequest, timeout_s: float
    ) -> list[ShardResultView]:
        """One GetShards ``request`` over the stream (unary if it breaks); one result per key."""
        deadline_s = asyncio.get_running_loop().time() + timeout_s
        results = None
        if self.use_get_stream:
            try:
                results = await self._stream_get(request, timeout_s)
            except StreamBroken as exc:
                log.debug("node %s: %s; retrying over unary GetShards", self.node_id, exc)
                if exc.code is grpc.StatusCode.UNIMPLEMENTED:
                    self.use_get_stream = False
        if results is None:
            timeout_s = deadline_s - asyncio.get_running_loop().time()
            results = await self.call("GetShards", request, timeout_s)
        if results is None or len(results) != len(request.keys):
            # gRPC hands the client None when the deserializer raised (it logs the error).
            raise BadReply(f"node {self.node_id} sent a malformed GetShards reply")
        return results

    async def _stream_get(
        self, request: pb.GetShardsRequest, timeout_s: float
    ) -> list[ShardResultView] | None:
        """One request over the node's GetShardsStream (opened on first use or after a break)."""
        if self._get_stream is None or not self._get_stream.is_open:
            self._get_stream = GetStream(
                lambda requests: self._open_get_stream(requests, metadata=self._metadata)
            )
        try:
            async with asyncio.timeout(max(timeout_s, 0.001)):
                results = await self._get_stream.send(request)
        except TimeoutError:
            self.health.record_failure(time.monotonic())
            raise DeadlineExceeded(
                f"node {self.node_id}: no GetShardsStream reply within {timeout_s:.3f} s"
            ) from None
        self.health.record_success()
        return results

    async def _put_batch(
        self, traffic_class: str, items: list[tuple[bytes, bytes]], timeout_s: float
    ) -> list[None]:
        request = pb.PutShardsRequest(tenant=self.tenant, traffic_class=traffic_class)
        for key, shard in items:
            request.shards.add(key=key, shard=shard)  # add() copies the shard once
        await self.call("PutShards", request, timeout_s)
        return [None] * len(items)

    async def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """Run one unary RPC (``method`` names a ShardStore RPC); raise KVStoreError on failure."""
        try:
            reply = await getattr(self.stub, method)(
                request, timeout=max(timeout_s, 0.001), metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NODE_FAULT_CODES:
                self.health.record_failure(time.monotonic())
                log.info("node %s failed %s: %s", self.node_id, method, exc.code().name)
            raise from_grpc_status(exc.code(), f"node {self.node_id}: {exc.details()}") from None
        self.health.record_success()
        return reply

    def is_suspect(self) -> bool:
        return self.health.is_suspect(time.monotonic())

    async def close(self) -> None:
        if self._get_stream is not None:
            await self._get_stream.close()
        await self.channel.close()


def consume_result(task: asyncio.Task[Any]) -> None:
    """Done-callback for RPC tasks nobody awaits any more: retrieve their exception."""
    if not task.cancelled():
        task.exception()
