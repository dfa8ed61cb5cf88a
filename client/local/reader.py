"""A node's local read transport: shared memory on the node's own host, falling back to the
node's other transport (UCX or gRPC). The client half of kvstore/node/local_server.py.

Which nodes are local is learned from each node's Health reply: a local socket and the same
boot id as this host. Then one :class:`~client.local.link.LocalLink` per node carries every
batch read to it (one READ and one ANSWER per node per batch; the payloads land through the
link's arena, copied and verified off the event loop).

Landing in place: with a landing pool (client/landing_pool.py), every request whose buffers
lie in the pool names, per key, the place its data shard goes there (kvstore/wire/landing.py),
and the node writes it there: nobody copies it. A request given up (hedging, a deadline) has
its permit revoked, so no node writes into a slot after the read returned; one whose node is
caught writing is waited for until the read's own deadline (a node descheduled mid-write on a
loaded host finishes it when it runs again), and only past that are its slots held (the read
reports their blocks as misses: client/batch_read.py).

Fallbacks, as over UCX: a link that cannot be made, is lost (node killed or restarted), or
leaves a request unanswered past half its time makes the request go over the fallback
transport within the same deadline; a lost link is made again from a fresh Health reply
(a restarted node has a new socket), at most every ``HEALTH_RETRY_S``. An arena with no free
region for a request (many requests in flight) or an answer too big for its region (several
versions of a key) also reads that request over the fallback. No path can return other
bytes than the nodes stored: every shard is verified after it landed, and every block after
it decoded (client/batch_read.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from client.landing import NodeAnswer, Wanted
from client.landing_pool import LandingPool
from client.local.link import LocalLink, PendingRead, RegionTooSmall
from client.node_conn import BackgroundTasks, NodeConn, NodeReader, finish_despite_cancel
from erasure.codec import Codec
from kvstore.errors import KVStoreError, PermissionDenied, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import local_frames as frames
from kvstore.wire.landing import NO_PLACE, PLACE_DTYPE

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
HEALTH_RETRY_S = 2.0  # at most one Health ask (and link attempt) per node this often
WAIT_SHARE = 0.5  # of the time left that a local wait may use (the rest is for the fallback)
REGION_SLACK = 2  # a request's region holds this many times its payload estimate
MIN_ARENA_BYTES = 64 << 20
POOL_WRITE_WAIT_S = 0.1  # the least a cancel waits for a node caught writing into the pool


@dataclass
class LocalCounters:
    """What the local read path did (monotonic counts, for tests and benchmarks)."""

    num_local_replies: int = 0  # node requests answered over the local channel
    num_local_shards: int = 0  # shard payloads that came through it
    num_landed_in_place: int = 0  # payloads copied straight into a caller's block
    num_fallbacks: int = 0  # node requests that went to the fallback after the channel failed
    num_links: int = 0  # links opened (a restarted node makes a new one)
    num_arena_full: int = 0  # requests read over the fallback for want of arena space
    num_placed: int = 0  # payloads the node put straight at their place in the landing pool
    num_pool_write_waits: int = 0  # cancelled requests whose node was caught writing
    num_held_requests: int = 0  # of those, the ones still writing at the deadline (slots held)


class LocalReads:
    """What every node's local reader shares: who we are, the counters, the background asks."""

    def __init__(
        self,
        codec: Codec,
        tenant: str,
        token: str | None,
        arena_bytes: int,
        pool: LandingPool | None = None,
    ) -> None:
        self.codec, self.tenant, self.token = codec, tenant, token
        self.pool = pool  # the landing pool every link shares with its node
        self.arena_bytes = max(arena_bytes, MIN_ARENA_BYTES)
        self.boot_id = frames.boot_id()
        self.counters = LocalCounters()
        self.readers: list[LocalReader] = []
        self.background = BackgroundTasks()

    def reader(self, conn: NodeConn, fallback: NodeReader) -> LocalReader:
        reader = LocalReader(conn, self, fallback)
        self.readers.append(reader)
        return reader

    async def close(self) -> None:
        """Stop background asks and close every link."""
        await self.background.cancel_all()
        links = [r.link for r in self.readers if r.link is not None]
        await asyncio.gather(*(asyncio.to_thread(link.close) for link in links))


class LocalReader:
    """One node's read transport: the local channel where it works, else ``fallback``."""

    kind = "local"  # what the links are, for logs

    def __init__(self, conn: NodeConn, shared: LocalReads, fallback: NodeReader) -> None:
        self.conn = conn
        self.node_id = conn.node_id
        self.fallback = fallback
        self.link: LocalLink | None = None
        self._shared = shared
        self._next_health_ask_s = 0.0
        self._asking = False

    def usable(self) -> bool:
        """Whether a read goes over the local channel now; (re)learns it in the background."""
        link = self.link
        if link is not None and link.alive and not self.conn.is_suspect():
            return True
        self._ask_health_later()
        return False

    async def observe(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Ask the node's Health whether it is on this host, and open a link if so.

        A node that refuses the link (a bad token, a tenant the token may not act for)
        raises PermissionDenied; anything else leaves the node on its fallback.
        """
        try:
            reply = await self.conn.recent_health(timeout_s)
        except KVStoreError as exc:
            log.debug("node %s: no Health reply to link it: %s", self.node_id, exc)
            return
        opener = self._opener(reply)
        if opener is None:
            return
        try:
            link = await asyncio.to_thread(opener)
        except PermissionDenied:
            raise
        except KVStoreError as exc:
            log.info("node %s: no %s link: %s", self.node_id, self.kind, exc)
            return
        self._adopt(link)

    def _opener(self, reply: pb.HealthReply) -> Callable[[], LocalLink] | None:
        """How to link the node its Health ``reply`` describes (blocking), or None: here
        over its local socket, when it runs on this host."""
        shared = self._shared
        if not reply.local_socket or not reply.boot_id or reply.boot_id != shared.boot_id:
            return None
        return functools.partial(
            LocalLink.open,
            self.node_id,
            reply.local_socket,
            shared.token,
            shared.tenant,
            shared.arena_bytes,
            shared.codec,
            shared.pool,
            node_pid=reply.node_pid,
        )

    def _adopt(self, link: LocalLink) -> None:
        """Read over ``link`` from now on; the link it replaces is closed in the background."""
        old, self.link = self.link, link
        self._shared.counters.num_links += 1
        if old is not None:
            self._shared.background.start(asyncio.to_thread(old.close))

    async def read_batch(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        timeout_s: float,
    ) -> NodeAnswer:
        """As :meth:`NodeConn.read_batch`, over the local channel when it is usable."""
        deadline_s = time.monotonic() + timeout_s
        link = self.link
        if not self.usable() or link is None:
            return await self.fallback.read_batch(keys, wanted, outs, timeout_s)
        counters = self._shared.counters
        region = link.arena.try_take(REGION_SLACK * self._estimate(wanted, outs))
        if region is None:
            counters.num_arena_full += 1
            return await self.fallback.read_batch(keys, wanted, outs, timeout_s)
        try:
            pending = link.submit(keys, b"", wanted, outs, region, self._places(link, wanted, outs))
        except Unavailable as exc:
            region.release()  # never sent: the node cannot write it
            return await self._fall_back(keys, wanted, outs, deadline_s, exc)
        try:
            done, _ = await asyncio.wait({pending.future}, timeout=_share(deadline_s))
        except asyncio.CancelledError:
            await self._abandon(link, pending, deadline_s)
            raise
        if not done:
            await self._abandon(link, pending, deadline_s)
            return await self._fall_back(keys, wanted, outs, deadline_s, TimeoutError())
        try:
            answer = pending.future.result()
        except (Unavailable, RegionTooSmall) as exc:
            # A link lost while its node wrote into the pool: that node may live on and finish
            # the write, so its slots wait until it did (or is gone) before anyone reads them.
            if not link.alive and not link.pool_write_over(pending):
                await self._wait_for_pool_write(link, pending, deadline_s)
            return await self._fall_back(keys, wanted, outs, deadline_s, exc)
        self.conn.health.record_success()
        counters.num_local_replies += 1
        counters.num_local_shards += len(answer.payloads)
        counters.num_landed_in_place += sum(answer.in_place)
        counters.num_placed += int((answer.entries["placed"] != 0).sum())
        return answer

    def _places(
        self, link: LocalLink, wanted: Wanted, outs: Sequence[memoryview | None]
    ) -> np.ndarray | None:
        """Per request key, where its data shard goes in the landing pool (a PLACE_DTYPE
        row; NO_PLACE: through the arena); None when the link has no pool or nothing fits."""
        pool, k = link.pool, self._shared.codec.k
        if pool is None or wanted.pool_offsets is None:
            return None
        places = np.zeros(len(wanted.positions), PLACE_DTYPE)
        offsets = [NO_PLACE if o is None else o for o in wanted.pool_offsets]
        places["offset"] = offsets
        lengths = np.array([len(outs[p] or b"") for p in wanted.positions], np.uint64)
        places["payload_bytes"] = (lengths + k - 1) // k
        places["shard_index"] = indexes = wanted.shard_indexes
        stride = pool.slot_stride
        starts = places["offset"]
        places["capacity_bytes"] = (starts // stride + 1) * stride - starts
        usable = (starts != NO_PLACE) & (np.asarray(indexes) < k) & (lengths > 0)
        if not usable.any():
            return None
        places["offset"][~usable] = NO_PLACE
        return places

    def _estimate(self, wanted: Wanted, outs: Sequence[memoryview | None]) -> int:
        if wanted.payload_bytes is not None:  # the batch read summed it already
            return wanted.payload_bytes
        codec = self._shared.codec
        return sum(
            codec.payload_bytes(len(out) if out is not None else codec.max_block_bytes)
            for out in (outs[p] for p in wanted.positions)
        )

    async def _abandon(self, link: LocalLink, pending: PendingRead, deadline_s: float) -> None:
        """Give up a request. If our receiver is landing its answer into the caller's
        buffers, wait until it is done and drop the answer; if the node was caught writing
        into the pool, see :meth:`_wait_for_pool_write`."""
        if not link.abandon(pending):
            return
        if pending.landing:
            future = pending.future
            try:
                await finish_despite_cancel(future)
            except KVStoreError:
                pass
            finally:
                if future.done() and not future.cancelled() and future.exception() is None:
                    future.result().release()
            return
        await finish_despite_cancel(self._wait_for_pool_write(link, pending, deadline_s))

    async def _wait_for_pool_write(
        self, link: LocalLink, pending: PendingRead, deadline_s: float
    ) -> None:
        """Wait until the node caught writing ``pending`` into the pool is done, up to the
        read's deadline (at least POOL_WRITE_WAIT_S); past that, hold the request's slots
        (client/landing_pool.py), so their blocks are misses. Why the deadline and not a
        short timer: the node claimed the permit, so the write is under way and short, but on
        a loaded host its process may be off the CPU for far longer than the copy takes, and
        holding the slots would make a miss of every block the request named, even blocks the
        other nodes' shards decoded whole."""
        if link.pool_write_over(pending):
            return
        self._shared.counters.num_pool_write_waits += 1
        give_up_s = max(deadline_s, time.monotonic() + POOL_WRITE_WAIT_S)
        pause_s = 0.0002
        while not link.pool_write_over(pending):
            if time.monotonic() >= give_up_s:
                assert link.pool is not None
                self._shared.counters.num_held_requests += 1
                link.pool.hold(link.pool_offsets(pending), lambda: link.pool_write_over(pending))
                return
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, 0.01)

    async def _fall_back(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        deadline_s: float,
        why: BaseException,
    ) -> NodeAnswer:
        """The request over the fallback transport; a lost link is made again later."""
        self._shared.counters.num_fallbacks += 1
        log.info("node %s: local read failed (%r); using its fallback", self.node_id, why)
        link = self.link
        if link is not None and not link.alive:
            self._next_health_ask_s = 0.0
            self._ask_health_later()
        return await self.fallback.read_batch(
            keys, wanted, outs, max(deadline_s - time.monotonic(), 0.001)
        )

    def _ask_health_later(self) -> None:
        now_s = time.monotonic()
        if self._asking or now_s < self._next_health_ask_s:
            return
        self._next_health_ask_s = now_s + HEALTH_RETRY_S
        self._asking = True
        self._shared.background.start(self.observe_quietly())

    async def observe_quietly(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """:meth:`observe`, a refusal logged rather than raised (the reads' own calls report
        it): for "auto", where a node that will not link is simply read another way."""
        try:
            await self.observe(timeout_s)
        except PermissionDenied as exc:  # the fallback's own calls report it
            log.warning("node %s refused a local link: %s", self.node_id, exc)
        finally:
            self._asking = False


def _share(deadline_s: float) -> float:
    """How long a local wait may take: half the time left, so a fallback has the rest."""
    return max(deadline_s - time.monotonic(), 0.001) * WAIT_SHARE
