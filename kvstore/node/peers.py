"""A node's gRPC channels to the other nodes of its cluster (for the repair service).

The client package talks to nodes for applications; a node talking to its peers needs far
less (no hedging, no batching across callers, no UCX), and the store side may not import the
client (the layers go erasure/ttl, kvstore, client), so this is its own small shell: one
channel per peer, made on first use and kept, over the cluster's TLS (the node's own
certificate, kvstore/tls.py; each channel accepts only the certificate of the node it is
for) with the node principal's token from ``peer_token_file`` (re-read when rotated), every
call with a deadline. Failures come back as kvstore.errors exceptions (kvstore/errors.py maps
the codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvstore.auth import TokenFile
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import KVStoreError
from kvstore.grpc_errors import from_grpc_status
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import aio_channel, node_channel_credentials

_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class Peers:
    """Stubs of the cluster's nodes, by node id."""

    def __init__(self, cluster: ClusterConfig, node: NodeConfig, timeout_s: float) -> None:
        self._addresses = {n.id: n.address for n in cluster.nodes}
        self._credentials = node_channel_credentials(cluster, node)
        self._token = TokenFile(node.peer_token_file)
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, ShardStoreStub] = {}

    async def call(self, node_id: str, method: str, request: Any) -> Any:
        """One unary RPC to ``node_id``; a failure raises the kvstore error for its code."""
        stub = self._stub(node_id)
        try:
            return await getattr(stub, method)(
                request, timeout=self.timeout_s, metadata=self._token.metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_status(exc.code(), f"node {node_id}: {exc.details()}") from None

    async def health(self, node_id: str) -> pb.HealthReply | None:
        """The node's Health reply, or None if it does not answer."""
        try:
            return await self.call(node_id, "Health", pb.HealthRequest())
        except KVStoreError:
            return None

    async def list_shards(
        self, node_id: str, group: int, start_after: bytes, limit: int
    ) -> pb.ListShardsReply:
        request = pb.ListShardsRequest(group=group, start_after=start_after, limit=limit)
        return await self.call(node_id, "ListShards", request)

    async def get_shard(self, node_id: str, tenant: str, key: bytes, version: bytes) -> bytes:
        """The node's shard of ``key`` at ``version``, or b"" (a miss or a corrupt shard)."""
        request = pb.GetShardsRequest(tenant=tenant, keys=[key], version=version)
        reply = await self.call(node_id, "GetShards", request)
        result = reply.results[0]
        return result.shards[0] if result.status == pb.HIT and result.shards else b""

    async def put_shards(
        self,
        node_id: str,
        request: pb.PutShardsRequest,
        shards: Sequence[tuple[bytes, bytes, float]],
    ) -> pb.PutShardsReply:
        """``request`` with ``shards`` as (key, shard, written_at_s)."""
        del request.shards[:]
        for key, shard, written_at_s in shards:
            request.shards.add(key=key, shard=shard, written_at_s=written_at_s)
        return await self.call(node_id, "PutShards", request)

    def _stub(self, node_id: str) -> ShardStoreStub:
        stub = self._stubs.get(node_id)
        if stub is None:
            channel = aio_channel(
                self._addresses[node_id], self._credentials, _CHANNEL_OPTIONS, node_id=node_id
            )
            self._channels[node_id] = channel
            stub = self._stubs[node_id] = ShardStoreStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
