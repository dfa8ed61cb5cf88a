"""A node's UCX read transport, falling back to gRPC: the client half of kvstore/wire/ucx_frames.py.

One batch read from one node::

    expect reply frame (tag_base + 0)       allocated at its size on arrival
    expect payloads    (tag_base + 1 + i)   one group receive; regions named later
    request(keys, worker address, tag_base) --UCX-->  node
    reply: the answer's table (kvstore/wire/batch_answer.py)
        -> each HIT payload's region (client/landing.py): its place in the caller's block,
           or one scratch region of the client's arena for the rest
    land(regions): payload i is received straight into region i (over shared memory one
        CMA read by this process; payloads that arrived earlier were held unread)

Per node per batch: one request, one reply, one group receive and one future, whatever the
number of shards; per shard only a few native calls in the worker (kvstore/wire/ucx_worker.py says
why not one message per node). The shards are then verified like any other
(client/batch_read.py), so a UCX fault can lose a node's answer but never return wrong bytes.

Sessions. UCX has no TLS, so a request carries no token: it is signed with the key of a
session the client opened over the node's identity-checked gRPC channel
(``OpenUcxSession``), and only a reply signed with that key for that request is taken
(kvstore/wire/ucx_frames.py). A session belongs to one node process (its UCX address) and
is renewed in the background before it expires.

Fallbacks. No reply in time (node restarted, UCX failing), a reply the session's key did not
sign, or no payloads in time: the whole request goes over gRPC within the same deadline
(``NodeConn.read_batch`` lands into the same regions), and the node is read over gRPC for
``UCX_RETRY_S``. Whether a node is worth asking over UCX is learned from its Health reply (its
UCX worker address) and a session opened after it, in the background: until then, and for a
node without either, reads use gRPC. A failed UCX read asks Health again, which also notices a
restarted node's new address. A node that failed recently (gRPC) is asked over gRPC too, whose
connection errors tell at once that a node is down.

Nothing lands after a read returns or is cancelled: both receives are cancelled in a
``finally`` that runs to its end (the worker waits for a transfer already matched).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from client.landing import NodeAnswer, Wanted, fill_apart, landing_regions
from client.node_conn import BackgroundTasks, NodeConn, NodeReader, finish_despite_cancel
from client.ucx.transport import UcxTransport
from kvstore.byte_arena import ByteArena, Region
from kvstore.errors import BadReply, KVStoreError, PermissionDenied, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import batch_answer
from kvstore.wire import ucx_frames as frames
from kvstore.wire.ucx_worker import GroupReceive, UcxWorker, batch_tag

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
HEALTH_RETRY_S = 5.0  # at most one background Health ask per node this often
MAX_REPLY_BYTES = 64 << 20  # a reply frame is allocated at its size; this only bounds it
UCX_WAIT_SHARE = 0.5  # of the time left that a UCX wait may use (the rest is for gRPC)
UCX_RETRY_S = 10.0  # a node that left a UCX request unanswered is read over gRPC this long
SESSION_RENEW_S = 60.0  # a session this close to expiring is renewed in the background
SCRATCH_BYTES = 256 << 20  # payloads with no place in a caller's block (parity) land here


@dataclass
class UcxCounters:
    """What the UCX read path did (monotonic counts, for tests and benchmarks)."""

    num_ucx_replies: int = 0  # node requests asked and answered over UCX
    num_ucx_shards: int = 0  # shard payloads that arrived over UCX
    num_fallbacks: int = 0  # node requests that went over gRPC after UCX failed
    num_landed_in_place: int = 0  # payloads UCX wrote straight into a caller's block


@dataclass(frozen=True)
class UcxSession:
    """A session one node process handed out over gRPC (kvstore/node/ucx_sessions.py)."""

    node_address: bytes  # the UCX address of the process that opened it
    session_id: bytes
    key: bytes
    renew_at_s: float  # time.monotonic() after which a new one is opened


class UcxReads:
    """What every node's UCX reader shares: the transport, its scratch arena, counters."""

    def __init__(self, transport: UcxTransport) -> None:
        self.transport = transport
        self.arena = ByteArena(SCRATCH_BYTES)
        self.counters = UcxCounters()
        self.background = BackgroundTasks()

    def reader(self, conn: NodeConn, fallback: NodeReader | None = None) -> UcxReader:
        return UcxReader(conn, self, fallback)

    async def close(self) -> None:
        """Stop background Health asks and close the UCX worker."""
        await self.background.cancel_all()
        await self.transport.close()


class UcxReader:
    """One node's read transport: UCX where it works, else (and on failure) ``fallback``
    (the stream channel, or gRPC)."""

    def __init__(
        self, conn: NodeConn, shared: UcxReads, fallback: NodeReader | None = None
    ) -> None:
        self.conn = conn
        self.fallback: NodeReader = conn if fallback is None else fallback
        self.node_id = conn.node_id
        self.health = conn.health
        self._shared = shared
        self._next_health_ask_s = 0.0
        self._grpc_until_s = 0.0  # no UCX reply came: read over gRPC until then
        self.session: UcxSession | None = None  # with this node process (None: gRPC)
        self.refused: PermissionDenied | None = None  # why the last session was refused

    def usable(self) -> bool:
        """Whether to ask the node over UCX now; learns its address and opens a session
        in the background."""
        transport = self._shared.transport
        address = transport.node_address(self.node_id)
        session = self.session
        if address is None or session is None or session.node_address != address:
            self._ask_health_later()
            return False
        now_s = time.monotonic()
        if now_s > session.renew_at_s:
            self._ask_health_later()  # used until the node forgets it
        if now_s < self._grpc_until_s or self.conn.is_suspect():
            return False
        return transport.reachable(self.node_id)

    async def observe(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Ask the node's Health for its UCX address and record it, then open a session with
        that process if there is none or it is due for renewal (errors: unknown)."""
        try:
            reply = await self.conn.recent_health(timeout_s)
        except KVStoreError as exc:
            log.debug("node %s: no Health reply for its UCX address: %s", self.node_id, exc)
            return
        address = reply.ucx_worker_address
        if not address:
            self._shared.transport.forget_node(self.node_id)
            return
        self._shared.transport.observe_node(self.node_id, address)
        session = self.session
        if session is None or session.node_address != address:
            self.session = await self._open_session(address, timeout_s)
        elif time.monotonic() > session.renew_at_s:
            self.session = await self._open_session(address, timeout_s) or session

    async def _open_session(self, address: bytes, timeout_s: float) -> UcxSession | None:
        try:
            reply = await self.conn.call("OpenUcxSession", pb.UcxSessionRequest(), timeout_s)
        except KVStoreError as exc:
            log.info("node %s: no UCX session (%s); reads use gRPC", self.node_id, exc)
            self.refused = exc if isinstance(exc, PermissionDenied) else None
            return None
        self.refused = None
        renew_at_s = time.monotonic() + max(reply.expires_in_s - SESSION_RENEW_S, 0.0)
        return UcxSession(address, reply.session_id, reply.key, renew_at_s)

    async def read_batch(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        timeout_s: float,
    ) -> NodeAnswer:
        """As :meth:`NodeConn.read_batch`, over UCX when the node is usable."""
        deadline_s = time.monotonic() + timeout_s
        if not self.usable():
            return await self.fallback.read_batch(keys, wanted, outs, timeout_s)
        try:
            answer = await self._read_ucx(keys, wanted, outs, deadline_s)
        except (Unavailable, TimeoutError) as exc:
            answer = None
            if isinstance(exc, frames.UnverifiedReply):
                self.session = None  # the node forgot it, or another process answered
            log.info("node %s: UCX read failed (%s); reading over gRPC", self.node_id, exc)
        if answer is None:
            return await self._fall_back(keys, wanted, outs, deadline_s)
        self._shared.counters.num_ucx_replies += 1
        return answer

    async def _read_ucx(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        deadline_s: float,
    ) -> NodeAnswer | None:
        transport = self._shared.transport
        worker = transport.worker
        tag_base = transport.next_tag_base()
        reply_tag = batch_tag(tag_base, frames.REPLY_INDEX)
        reply_box: list[memoryview] = []

        def allocate(num_bytes: int) -> memoryview:
            reply_box.append(memoryview(bytearray(num_bytes)))
            return reply_box[0]

        session = self.session
        if session is None:  # usable() saw one; a failed read dropped it meanwhile
            return None
        reply = worker.receive(reply_tag, allocate, MAX_REPLY_BYTES)
        payloads = worker.receive_group(tag_base, frames.FIRST_PAYLOAD_INDEX)
        scratch: Region | None = None
        try:
            delivery = pb.UcxDelivery(worker_address=transport.address, tag_base=tag_base)
            request = pb.GetShardsRequest(tenant=self.conn.tenant, keys=keys, ucx=delivery)
            frame = frames.encode_request(request, session.session_id, session.key)
            transport.send_request(self.node_id, frame)
            reply_bytes = await asyncio.wait_for(reply, _ucx_share(deadline_s))
            frames.verify_reply(reply_box[0][:reply_bytes], session.key, tag_base)
            self.health.record_success()
            try:
                table = frames.decode_reply(reply_box[0][:reply_bytes])
                entries, payload_bytes = batch_answer.decode_table(table, len(keys))
            except ValueError as exc:
                raise BadReply(f"node {self.node_id} sent a malformed UCX reply: {exc}") from None
            hits = entries["status"] == batch_answer.HIT
            regions = landing_regions(entries, wanted, outs, self.conn.k)
            in_place = [region is not None for region in regions]
            sizes = entries["payload_bytes"][hits].tolist()
            scratch = fill_apart(regions, sizes, self._shared.arena) if payload_bytes else None
            payloads.land(regions)
            await asyncio.wait_for(payloads.future, _ucx_share(deadline_s))
            counters = self._shared.counters
            counters.num_ucx_shards += len(sizes)
            counters.num_landed_in_place += sum(in_place)
            landed = [r for r in regions if r is not None]
            answer = NodeAnswer(entries, landed, in_place, [scratch] if scratch else [])
            scratch = None  # the answer owns it now
            return answer
        finally:
            await finish_despite_cancel(self._close(worker, reply_tag, payloads, scratch))

    @staticmethod
    async def _close(
        worker: UcxWorker, reply_tag: int, payloads: GroupReceive, scratch: Region | None
    ) -> None:
        """Cancel both receives (waiting for transfers in progress), then free the scratch."""
        await worker.cancel(reply_tag)
        await worker.cancel_group(payloads)
        if scratch is not None:
            scratch.release()

    async def _fall_back(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        deadline_s: float,
    ) -> NodeAnswer:
        """The request over gRPC; the node is read over gRPC for a while, and Health is
        asked for its address (a restart changes it)."""
        self._grpc_until_s = time.monotonic() + UCX_RETRY_S
        self._shared.counters.num_fallbacks += 1
        self._next_health_ask_s = 0.0
        self._ask_health_later()
        return await self.fallback.read_batch(keys, wanted, outs, _left(deadline_s))

    def _ask_health_later(self) -> None:
        now_s = time.monotonic()
        if now_s < self._next_health_ask_s:
            return
        self._next_health_ask_s = now_s + HEALTH_RETRY_S
        self._shared.background.start(self.observe())


def _left(deadline_s: float) -> float:
    return max(deadline_s - time.monotonic(), 0.001)


def _ucx_share(deadline_s: float) -> float:
    """How long a UCX wait may take: half the time left, so a gRPC retry has the rest."""
    return _left(deadline_s) * UCX_WAIT_SHARE
