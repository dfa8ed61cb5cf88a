"""Batched shard gets whose payloads come over UCX: the client half of the node's ucx_get.py.

One batch to one node (the keys the batcher coalesced, client/batcher.py)::

    slot i = one shard-sized buffer per key      new_batch(payload part of each slot)
    GetShards(keys, ucx={address, tag_base})  -> reply: status + 48-byte header per HIT
    wait(HIT indexes) -> payload i landed in slot i after the header's place
    slot i = header + payload: a whole shard      -> ShardResultView, as over gRPC

The shard is then verified like any other (ShardCollector runs codec.verify: header, length,
shard checksum; the codec checks the block checksum), so a UCX fault can lose a shard but never
return wrong bytes. A payload that does not arrive (node restarted, UCX failed, slot too small)
is fetched again over gRPC in the same deadline; a node whose answer came without UCX simply
answered inline. Whether a node is worth asking over UCX is learned from its Health reply (its
UCX worker address) in the background: until then, and for a node without one, reads use gRPC.
A failed UCX delivery asks Health again, which also notices a restarted node's new address.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from client.ucx_transport import UcxTransport
from client.wire import ShardResultView
from erasure.shard import HEADER_BYTES
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb

if TYPE_CHECKING:
    from client.node_conn import NodeConn

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
HEALTH_RETRY_S = 5.0  # at most one background Health ask per node this often


@dataclass
class UcxCounters:
    """What the UCX read path did (monotonic counts, for tests and benchmarks)."""

    num_ucx_shards: int = 0  # shards whose payload arrived over UCX
    num_inline_shards: int = 0  # HITs a node answered inline although UCX was asked
    num_fallbacks: int = 0  # payloads that did not arrive and were fetched over gRPC


class UcxGets:
    """A client's UCX reads: one :class:`UcxTransport` shared by every node connection."""

    def __init__(self, transport: UcxTransport, slot_payload_bytes: int) -> None:
        self.transport = transport
        self.slot_payload_bytes = slot_payload_bytes  # the largest shard payload a block has
        self.counters = UcxCounters()
        self._node_to_next_ask_s: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()

    def reachable(self, conn: NodeConn) -> bool:
        """Whether to ask ``conn``'s node over UCX; learns its address in the background."""
        if self.transport.node_address(conn.node_id) is None:
            self._ask_health_later(conn)
            return False
        return self.transport.reachable(conn.node_id)

    async def observe(self, conn: NodeConn) -> None:
        """Ask the node's Health for its UCX address and record it (errors: unknown)."""
        try:
            reply = await conn.call("Health", pb.HealthRequest(), HEALTH_TIMEOUT_S)
        except KVStoreError as exc:
            log.debug("node %s: no Health reply for its UCX address: %s", conn.node_id, exc)
            return
        if reply.ucx_worker_address:
            self.transport.observe_node(conn.node_id, reply.ucx_worker_address)
        else:
            self.transport.forget_node(conn.node_id)

    async def get_batch(
        self, conn: NodeConn, keys: list[bytes], timeout_s: float
    ) -> list[ShardResultView]:
        """One result per key, as :meth:`NodeConn.send_get` gives, newest payloads over UCX."""
        deadline_s = time.monotonic() + timeout_s
        slots = [memoryview(bytearray(HEADER_BYTES + self.slot_payload_bytes)) for _ in keys]
        async with self.transport.new_batch([slot[HEADER_BYTES:] for slot in slots]) as batch:
            delivery = pb.UcxDelivery(
                worker_address=self.transport.address, tag_base=batch.tag_base
            )
            request = pb.GetShardsRequest(tenant=conn.tenant, keys=keys, ucx=delivery)
            results = await conn.send_get(request, timeout_s)
            hits = [i for i, result in enumerate(results) if result.ucx_header is not None]
            counts = await batch.wait(hits, max(deadline_s - time.monotonic(), 0.0))
        self.counters.num_inline_shards += sum(
            1 for r in results if r.status == pb.HIT and r.ucx_header is None
        )
        missing = self._join(results, slots, hits, counts)
        if missing:
            await self._refetch(conn, keys, results, missing, deadline_s)
        return results

    def _join(
        self,
        results: list[ShardResultView],
        slots: list[memoryview],
        hits: list[int],
        counts: list[int | None],
    ) -> list[int]:
        """Put each delivered payload behind its header, in place; the undelivered indexes."""
        missing = []
        for index, num_bytes in zip(hits, counts, strict=True):
            result = results[index]
            if num_bytes is None or result.ucx_header is None:
                missing.append(index)
                continue
            slot = slots[index]
            slot[:HEADER_BYTES] = result.ucx_header
            results[index] = ShardResultView(
                result.status, [slot[: HEADER_BYTES + num_bytes], *result.shards]
            )
            self.counters.num_ucx_shards += 1
        return missing

    async def _refetch(
        self,
        conn: NodeConn,
        keys: list[bytes],
        results: list[ShardResultView],
        missing: list[int],
        deadline_s: float,
    ) -> None:
        """Fetch the undelivered keys again over gRPC; ask Health (a restart?) meanwhile."""
        self.counters.num_fallbacks += len(missing)
        log.info("node %s: %d UCX payloads missing, fetching over gRPC", conn.node_id, len(missing))
        self._node_to_next_ask_s.pop(conn.node_id, None)
        self._ask_health_later(conn)
        request = pb.GetShardsRequest(tenant=conn.tenant, keys=[keys[i] for i in missing])
        retried = await conn.send_get(request, max(deadline_s - time.monotonic(), 0.001))
        for index, result in zip(missing, retried, strict=True):
            results[index] = result

    def _ask_health_later(self, conn: NodeConn) -> None:
        now_s = time.monotonic()
        if now_s < self._node_to_next_ask_s.get(conn.node_id, 0.0):
            return
        self._node_to_next_ask_s[conn.node_id] = now_s + HEALTH_RETRY_S
        task = asyncio.ensure_future(self.observe(conn))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Stop background Health asks and close the UCX worker."""
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.transport.close()
