"""One storage node as the client sees it: a reused gRPC channel, its stub and its health.

Every RPC to a node goes through :meth:`NodeConn.call`, which attaches the bearer token, turns
a failed RPC into the kvstore.errors exception for its status code (one mapping, in
kvstore/errors.py) and keeps :class:`client.node_health.NodeHealth` up to date.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from client.node_health import NodeHealth
from kvstore.config import NodeConfig
from kvstore.errors import from_grpc_status
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    # Blocks are up to 16 MiB and batches larger; the node enforces its own request limit.
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # gRPC's default reconnect backoff grows to 120 s; a restarted node should be found fast.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
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


class NodeConn:
    """Channel, stub and health of one node; create inside the event loop that uses it."""

    def __init__(self, node: NodeConfig, token: str | None) -> None:
        self.node_id = node.id
        self.address = node.address
        self.channel = grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS)
        self.stub = ShardStoreStub(self.channel)
        self.health = NodeHealth()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

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
        await self.channel.close()


def consume_result(task: asyncio.Task[Any]) -> None:
    """Done-callback for RPC tasks nobody awaits any more: retrieve their exception."""
    if not task.cancelled():
        task.exception()
