"""Batched shard gets asked and answered over UCX: the client half of kvstore/ucx_get.py.

One batch to one node (the keys the batcher coalesced, client/batcher.py)::

    key i's slot: its landing (get_into: the shard's place in the caller's block)
                  or a buffer allocated when the payload arrives, of exactly its size
    slot len(keys): the reply frame, allocated on arrival
    request(keys, worker address, tag_base) --UCX-->  node
    wait(reply) -> status + 48-byte header per HIT sent as a message (small payloads inline)
    wait(those HITs) -> payload i landed in slot i
    SplitShard(header i, payload i)           -> ShardResultView, as over gRPC

A ``get_into`` passes, for each data shard lying wholly inside its block, a
:class:`PayloadLanding`: the slice of the caller's buffer where that shard's payload belongs.
UCX writes the payload there (over shared memory the client pulls it with one CMA read from
the node's memory), so with every data shard present the block is complete when the last
payload lands: no full-block copy but the transport's own, and the decoder only verifies
(erasure/codec.py skips payloads already in place). Parity shards, the zero-padded last data
shard and plain ``get`` land in buffers allocated at arrival, and the decoder copies them.

The shard is then verified like any other (ShardCollector runs codec.verify: header, length,
shard checksum; the codec checks the block checksum), so a UCX fault can lose a shard but never
return wrong bytes. A payload that does not arrive (node restarted, UCX failed, slot too small)
is fetched again over gRPC in the same deadline, and so is a whole batch whose reply does not
come (the node then counts as failed: reads rank it last and ask it over gRPC, which notices a
dead node at once, until it answers again). Whether a node is worth asking over UCX is learned
from its Health reply (its UCX worker address) in the background: until then, and for a node
without one, reads use gRPC. A failed UCX read asks Health again, which also notices a
restarted node's new address.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from client.ucx_transport import UcxReceiveBatch, UcxTransport
from client.wire import ShardResultView, parse_get_shards_reply
from erasure.shard import HEADER_BYTES, SplitShard
from kvstore import ucx_get
from kvstore.errors import BadReply, KVStoreError, Unavailable
from kvstore.proto import kvstore_pb2 as pb

if TYPE_CHECKING:
    from client.node_conn import NodeConn

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
HEALTH_RETRY_S = 5.0  # at most one background Health ask per node this often
MAX_REPLY_BYTES = 256 << 20  # a reply frame is allocated at its size; this only bounds it
UCX_WAIT_SHARE = 0.5  # of the time left that a UCX wait may use (the rest is for gRPC)
UCX_RETRY_S = 10.0  # a node that left a UCX request unanswered is read over gRPC this long


@dataclass
class UcxCounters:
    """What the UCX read path did (monotonic counts, for tests and benchmarks)."""

    num_ucx_replies: int = 0  # batches asked and answered over UCX
    num_ucx_shards: int = 0  # shards whose payload arrived as a UCX message of its own
    num_inline_shards: int = 0  # HITs whose payload came inside the reply (small payloads)
    num_fallbacks: int = 0  # keys that got no UCX answer and were fetched over gRPC
    num_landed_in_place: int = 0  # payloads UCX wrote straight into a get_into buffer


_SHARD_INDEX_BYTE = 8  # erasure/shard.py: the header byte holding the shard's index


class PayloadLanding:
    """Where one data shard's payload belongs in a ``get_into`` buffer, for one read.

    The read (client/read_path.py) makes one per data shard that lies wholly inside its
    block and must :meth:`close` them all before it decodes or returns: closing cancels a
    receive not yet delivered and waits for one in progress, so that afterwards nothing but
    the decoder writes into the caller's buffer. A landing closed before its batch is sent
    is not used (that payload then lands in a buffer of its own).
    """

    def __init__(self, view: memoryview, shard_index: int) -> None:
        self.view = view
        self.shard_index = shard_index
        self.closed = False
        self._receive: tuple[UcxReceiveBatch, int] | None = None

    def attach(self, batch: UcxReceiveBatch, index: int) -> None:
        self._receive = (batch, index)

    async def close(self) -> None:
        self.closed = True
        if self._receive is not None:
            batch, index = self._receive
            await batch.cancel_one(index)
            self._receive = None  # only now: a close cut short by a cancel must be redone


class UcxGets:
    """A client's UCX reads: one :class:`UcxTransport` shared by every node connection."""

    def __init__(self, transport: UcxTransport, slot_payload_bytes: int) -> None:
        self.transport = transport
        self.slot_payload_bytes = slot_payload_bytes  # the largest shard payload a block has
        self.counters = UcxCounters()
        self._node_to_next_ask_s: dict[str, float] = {}
        self._node_to_ucx_retry_s: dict[str, float] = {}  # no UCX reply came: gRPC until then
        self._background: set[asyncio.Task[None]] = set()

    def reachable(self, conn: NodeConn) -> bool:
        """Whether to ask ``conn``'s node over UCX; learns its address in the background.

        A node that failed recently (gRPC) or left a UCX request unanswered is asked over
        gRPC, whose connection errors tell at once that a node is down (a UCX request to a
        dead peer is only noticed when its wait ends).
        """
        if self.transport.node_address(conn.node_id) is None:
            self._ask_health_later(conn)
            return False
        if time.monotonic() < self._node_to_ucx_retry_s.get(conn.node_id, 0.0):
            return False
        return not conn.is_suspect() and self.transport.reachable(conn.node_id)

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
        self,
        conn: NodeConn,
        keys: list[bytes],
        landings: list[PayloadLanding | None],
        timeout_s: float,
    ) -> list[ShardResultView]:
        """One result per key, as :meth:`NodeConn.send_get` gives, asked and answered over
        UCX; key i's payload lands in ``landings[i]`` when it is given and still open."""
        deadline_s = time.monotonic() + timeout_s
        in_place = [
            landing if landing is not None and not landing.closed else None for landing in landings
        ]
        reply_index = len(keys)  # the reply frame is the message after the payloads
        slots: list[Any] = [
            self.slot_payload_bytes if landing is None else landing.view for landing in in_place
        ]
        async with self.transport.new_batch([*slots, MAX_REPLY_BYTES]) as batch:
            for index, landing in enumerate(in_place):
                if landing is not None:
                    landing.attach(batch, index)
            delivery = pb.UcxDelivery(
                worker_address=self.transport.address, tag_base=batch.tag_base
            )
            request = pb.GetShardsRequest(tenant=conn.tenant, keys=keys, ucx=delivery)
            frame = ucx_get.encode_request(request, conn.token)
            try:
                sent = self.transport.send_request(conn.node_id, frame)
            except Unavailable as exc:
                log.info("node %s: UCX request not sent: %s", conn.node_id, exc)
                reply_bytes = None
            else:
                sent.add_done_callback(
                    functools.partial(self._cancel_if_failed, batch, reply_index)
                )
                (reply_bytes,) = await batch.wait([reply_index], _ucx_share(deadline_s))
            if reply_bytes is None:
                results = None
            else:
                conn.health.record_success()
                results = _parse_reply(conn, batch.received(reply_index, reply_bytes), len(keys))
                self.counters.num_ucx_replies += 1
                hits = [i for i, result in enumerate(results) if result.ucx_header is not None]
                self.counters.num_inline_shards += sum(
                    1 for r in results if r.status == pb.HIT and r.ucx_header is None
                )
                counts = await batch.wait(hits, _ucx_share(deadline_s))
                missing = self._join(batch, results, in_place, hits, counts)
        if results is None:
            return await self._fall_back(conn, keys, deadline_s)
        if missing:
            await self._refetch(conn, keys, results, missing, deadline_s)
        return results

    async def _fall_back(
        self, conn: NodeConn, keys: list[bytes], deadline_s: float
    ) -> list[ShardResultView]:
        """No reply over UCX (node gone or restarted, UCX failing): the batch over gRPC.

        The node is read over gRPC for UCX_RETRY_S (which also fails fast for a dead node,
        and ranks it last), and Health is asked for its address (a restart changes it).
        """
        self._node_to_ucx_retry_s[conn.node_id] = time.monotonic() + UCX_RETRY_S
        self.counters.num_fallbacks += len(keys)
        log.info("node %s: no UCX reply, reading %d keys over gRPC", conn.node_id, len(keys))
        self._node_to_next_ask_s.pop(conn.node_id, None)
        self._ask_health_later(conn)
        request = pb.GetShardsRequest(tenant=conn.tenant, keys=keys)
        return await conn.send_get(request, _left(deadline_s))

    def _join(
        self,
        batch: UcxReceiveBatch,
        results: list[ShardResultView],
        in_place: list[PayloadLanding | None],
        hits: list[int],
        counts: list[int | None],
    ) -> list[int]:
        """Pair each delivered payload with its header; the indexes to fetch again."""
        missing = []
        for index, num_bytes in zip(hits, counts, strict=True):
            result, landing = results[index], in_place[index]
            header = result.ucx_header
            assert header is not None  # hits are the results with a UCX header
            if num_bytes is None:
                if landing is None or not landing.closed:  # closed: the read is over
                    missing.append(index)
                results[index] = ShardResultView(result.status, result.shards)
                continue
            payload = batch.received(index, num_bytes)
            if landing is not None:
                if header[_SHARD_INDEX_BYTE] != landing.shard_index:
                    # Not the shard that belongs here: keep it, but not inside the block.
                    payload = memoryview(bytes(payload))
                else:
                    self.counters.num_landed_in_place += 1
            results[index] = ShardResultView(
                result.status, [SplitShard(header, payload), *result.shards]
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
        retried = await conn.send_get(request, _left(deadline_s))
        for index, result in zip(missing, retried, strict=True):
            results[index] = result

    def _cancel_if_failed(
        self, batch: UcxReceiveBatch, index: int, sent: asyncio.Future[None]
    ) -> None:
        """A request that could not be sent gets no reply: stop waiting for it at once."""
        if not sent.cancelled() and sent.exception() is not None:
            log.info("UCX request not sent: %s", sent.exception())
            task = asyncio.ensure_future(batch.cancel_one(index))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

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


def _left(deadline_s: float) -> float:
    return max(deadline_s - time.monotonic(), 0.001)


def _ucx_share(deadline_s: float) -> float:
    """How long a UCX wait may take: half the time left, so a gRPC retry has the rest."""
    return _left(deadline_s) * UCX_WAIT_SHARE


def _parse_reply(conn: NodeConn, frame: memoryview, num_keys: int) -> list[ShardResultView]:
    """The results of a reply frame; the node's refusal raised as its KVStoreError."""
    try:
        results = parse_get_shards_reply(ucx_get.decode_reply(frame))
    except ValueError as exc:
        raise BadReply(f"node {conn.node_id} sent a malformed UCX reply: {exc}") from None
    if len(results) != num_keys:
        raise BadReply(
            f"node {conn.node_id} answered {len(results)} results for {num_keys} keys over UCX"
        )
    if any(r.ucx_header is not None and len(r.ucx_header) != HEADER_BYTES for r in results):
        raise BadReply(f"node {conn.node_id} sent a shard header that is not {HEADER_BYTES} B")
    return results
