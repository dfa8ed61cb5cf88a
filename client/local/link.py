"""One connection to a node's local read server, with the memory the node writes into.

kvstore/wire/local_frames.py has the exchange. Per request::

    event loop    take a region of the arena, arm a permit when the request names places in
                  the landing pool, send READ(id, region, keys[, places, permit])  (a few us)
    node          data shards straight to their places in the pool (client/landing_pool.py),
                  the rest into arena[region]
    receiver      ANSWER(id, table) -> in this thread:
    thread          placed payloads: nothing to do, their bytes are where they belong (the
                    block checksum will cover them: client/batch_read.py)
                    the rest: copy arena[region + offset] -> its place in the caller's block
                    (client/landing.py), all in one native call; payloads with no place
                    (parity, a padded tail, plain get) stay in the region. No shard checksum
                    is checked here: the block checksum covers every byte once, and the
                    shards' own are checked only when it fails (client/batch_read.py)
                  -> the NodeAnswer to the event loop

So the event loop does no per-byte work: one send and one wake-up per node per batch, and a
read into the landing pool is copied by nobody.

Ownership. A region is the client's until the node answered its request: a cancelled
request (hedging, a deadline) keeps its region until the late ANSWER comes, so a late
payload lands only in memory nobody reads. The pool's places are guarded by the request's
permit word (kvstore/wire/landing.py): a cancel revokes it, and a node that had not claimed
it writes nothing there; one caught writing is waited for (:meth:`LocalLink.abandon` says
so). Landing and cancelling exclude each other (``PendingRead.lock``): once cancelled,
nothing more is written into the caller's buffers; a cancel that finds the landing under way
waits for it. A lost connection fails every request in flight, and the link with its arena
is dropped: the node may still be writing into regions of it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from client.landing import (
    NodeAnswer,
    Wanted,
    fill_tails,
    landing_regions,
)
from client.landing_pool import LandingPool
from erasure import fastsum
from erasure.codec import Codec
from kvstore.byte_arena import ByteArena, Region
from kvstore.errors import BadReply, KVStoreError, Unavailable
from kvstore.grpc_errors import code_from_value, from_grpc_status
from kvstore.wire import batch_answer, landing
from kvstore.wire import local_frames as frames
from kvstore.wire.stream_socket import StreamSocket

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
WAITING, LANDING, CANCELLED = 0, 1, 2
GENERATION_MASK = (1 << 30) - 1


class RegionTooSmall(Unavailable):
    """The node's answer did not fit the request's region (several versions of a key)."""


@dataclass
class PendingRead:
    """One request in flight: where its answer lands, and who resolves it."""

    request_id: int
    region: Region
    wanted: Wanted
    outs: Sequence[memoryview | None]
    num_keys: int
    future: asyncio.Future[NodeAnswer]
    loop: asyncio.AbstractEventLoop
    places: np.ndarray | None = None  # per key: its place in the pool (PLACE_DTYPE rows)
    permit_index: int = -1  # the permit word guarding the places (-1: none)
    permit_armed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: int = WAITING
    # Per HIT row of the answer, its place in the caller's block (or None), and the padded
    # tails (client/landing.py), when the payloads were received straight there (the stream
    # link) rather than into the region.
    received_in_place: tuple[list[memoryview | None], list[tuple[int, memoryview]]] | None = None

    @property
    def landing(self) -> bool:
        """Whether the receiver is landing this request's answer right now."""
        return self.state == LANDING


class LocalLink:
    """A connected, authenticated local read channel to one node. Create with :meth:`open`
    (blocking: call it in a thread); ``close()`` when done."""

    def __init__(
        self,
        node_id: str,
        sock: socket.socket,
        arena: ByteArena,
        codec: Codec,
        pool: LandingPool | None = None,
        node_pid: int | None = None,
    ) -> None:
        self.node_id = node_id
        self.arena = arena
        self.pool = pool  # the landing pool the node mapped (None: everything via the arena)
        self._sock = sock
        self._codec = codec
        self._lock = threading.Lock()
        self._pending: dict[int, PendingRead] = {}
        self._ids = itertools.count(1)
        # Permit words: the arena's first bytes (taken first, so at offset 0, as the node
        # expects); free indexes and each index's generation.
        self._permits = arena.take(frames.PERMIT_AREA_BYTES)
        assert self._permits.offset == 0, "permit words must open the arena"
        self._free_permits = list(range(frames.NUM_PERMITS - 1, -1, -1))
        self._generations = [0] * frames.NUM_PERMITS
        self.node_pid = _peer_pid(sock) if node_pid is None else node_pid
        self.alive = True
        self._receiver = threading.Thread(
            target=self._receive_forever, name=f"local-recv-{node_id}", daemon=True
        )
        self._receiver.start()

    @classmethod
    def open(
        cls,
        node_id: str,
        socket_name: str,
        token: str | None,
        tenant: str,
        arena_bytes: int,
        codec: Codec,
        pool: LandingPool | None = None,
        *,
        node_pid: int,
    ) -> LocalLink:
        """Connect, check that process ``node_pid`` holds the socket, send HELLO with a fresh
        shared arena (and the landing pool's memfd, when there is one and the native landing
        loop is built), and wait for WELCOME.

        ``node_pid`` is the pid the node's Health reply gave over the identity-checked gRPC
        channel: the kernel's peer credentials of the socket must name it before the token
        goes out, so a process that took the node's socket name first gets nothing.

        Raises the node's refusal as its kvstore.errors exception (PermissionDenied for a
        bad token or a tenant the token may not act for), Unavailable if it cannot connect
        or another process holds the socket.
        """
        if not landing.NATIVE or (pool is not None and pool.fd < 0):
            pool = None
        if not socket_name.startswith("@"):
            raise Unavailable(f"node {node_id}: local socket {socket_name!r} is not abstract")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        arena = ByteArena(arena_bytes, shared=True)
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            sock.connect("\0" + socket_name[1:])
            _check_peer(node_id, socket_name, sock, node_pid)
            pool_bytes = pool.num_bytes if pool is not None else 0
            hello = frames.encode_hello(token, tenant, arena.capacity_bytes, pool_bytes)
            shared = [arena.fd] if pool is None else [arena.fd, pool.fd]
            fds = array.array("i", shared).tobytes()
            sock.sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            await_welcome(node_id, sock)
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            arena.close()
            raise Unavailable(f"node {node_id}: local connection failed: {exc}") from None
        except BaseException:
            sock.close()
            arena.close()
            raise
        # The node holds its own copy of the memfd now; ours is not needed to map it again.
        arena.close()
        return cls(node_id, sock, arena, codec, pool)

    def submit(
        self,
        keys: list[bytes],
        version: bytes,
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        region: Region,
        places: np.ndarray | None = None,
    ) -> PendingRead:
        """Send one READ whose payloads go to ``region`` (taken from ``self.arena``) and, for
        keys with a place, to the landing pool; call on the event loop. Raises Unavailable
        if the link is down or the node does not read its socket."""
        loop = asyncio.get_running_loop()
        pending = PendingRead(
            next(self._ids), region, wanted, outs, len(keys), loop.create_future(), loop
        )
        with self._lock:
            if not self.alive:
                raise Unavailable(f"node {self.node_id}: local connection lost")
            if places is not None and self.pool is not None and self._free_permits:
                pending.places = places
                pending.permit_index = self._free_permits.pop()
            self._pending[pending.request_id] = pending
        permit = (0, 0)
        if pending.permit_index >= 0:
            index = pending.permit_index
            self._generations[index] = (self._generations[index] + 1) & GENERATION_MASK
            pending.permit_armed = landing.permit_value(self._generations[index], landing.ARMED)
            landing.permit_store(self._permit_address(index), pending.permit_armed)
            permit = (index, pending.permit_armed)
        frame = frames.encode_read(
            pending.request_id,
            region.offset,
            len(region.view),
            version,
            keys,
            pending.places,
            permit,
        )
        try:
            self._send_frame(frame)
        except OSError as exc:  # BlockingIOError: the node stopped reading its socket
            self._forget(pending)
            self._shut(f"send failed: {exc}")
            raise Unavailable(f"node {self.node_id}: local READ not sent: {exc}") from None
        return pending

    def abandon(self, pending: PendingRead) -> bool:
        """Give up on a request (cancelled, or past its time): nothing of it lands in the
        caller's buffers from now on. Returns True when writing is under way (the client's
        landing, or the node writing into the pool under the request's permit): then wait
        for ``pending.future`` (or :meth:`pool_write_over`) before the buffers are touched
        again."""
        with pending.lock:
            if pending.state == LANDING:
                return True
            pending.state = CANCELLED
        # If the send fails the node learns nothing; its late answer is dropped all the same.
        with contextlib.suppress(OSError):
            self._send_frame(frames.encode_cancel(pending.request_id))
        return not self._revoke(pending)

    def _send_frame(self, frame: bytes) -> None:
        """Send one frame from the event loop, never blocking it (OSError if it cannot)."""
        send_holding_gil(self._sock.fileno(), frame)

    def _revoke(self, pending: PendingRead) -> bool:
        """Revoke a request's permit; whether no pool write of it can still happen."""
        if pending.permit_index < 0:
            return True
        address = self._permit_address(pending.permit_index)
        revoked = landing.permit_value(pending.permit_armed >> 2, landing.REVOKED)
        held = landing.permit_cas(address, pending.permit_armed, revoked)
        return held == pending.permit_armed or held & landing.STATE_MASK == landing.DONE

    def pool_write_over(self, pending: PendingRead) -> bool:
        """Whether the node is done with the pool for ``pending`` (never claimed its permit,
        or finished writing), or its process is gone."""
        if pending.permit_index < 0:
            return True
        state = landing.permit_load(self._permit_address(pending.permit_index))
        if state >> 2 != pending.permit_armed >> 2 or state & landing.STATE_MASK != landing.WRITING:
            return True
        return not _process_alive(self.node_pid)

    def pool_offsets(self, pending: PendingRead) -> list[int]:
        """The pool offsets of the blocks ``pending`` names places in."""
        if pending.places is None:
            return []
        offsets = pending.places["offset"]
        return offsets[offsets != landing.NO_PLACE].tolist()

    def _permit_address(self, index: int) -> int:
        return self.arena.address + 4 * index

    def close(self) -> None:
        """End the connection; requests in flight fail with Unavailable."""
        self._shut("closed by the client")
        self._receiver.join()

    def _shut(self, why: str) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        log.debug("local link to %s: %s", self.node_id, why)

    def _forget(self, pending: PendingRead) -> None:
        with self._lock:
            self._pending.pop(pending.request_id, None)

    def _receive_forever(self) -> None:
        head = bytearray(frames.HEAD_BYTES)
        reason = "closed by the node"
        try:
            while (received := frames.recv_frame(self._sock, head)) is not None:
                kind, body = received
                if kind != frames.ANSWER:
                    raise ValueError(f"unexpected frame kind {kind}")
                request_id, status, rest = frames.decode_answer(memoryview(body))
                with self._lock:
                    pending = self._pending.get(request_id)
                self._receive_payloads(pending, status, rest)
                with self._lock:
                    pending = self._pending.pop(request_id, None)
                    if pending is not None and pending.permit_index >= 0:
                        # The node answered: it is done with the permit and the pool.
                        self._free_permits.append(pending.permit_index)
                if pending is not None:
                    self._complete(pending, status, rest)
        except (OSError, ValueError, KVStoreError) as exc:
            reason = str(exc)
        finally:
            with self._lock:
                self.alive = False
                lost, self._pending = list(self._pending.values()), {}
            self._sock.close()
            error = Unavailable(f"node {self.node_id}: local connection lost ({reason})")
            for pending in lost:  # their regions stay taken: the arena goes with the link
                _resolve(pending, error)

    def _receive_payloads(self, pending: PendingRead | None, status: int, body: memoryview) -> None:
        """What follows an ANSWER on the connection: here nothing (the payloads are in the
        shared arena already); the stream link receives them (client/stream/link.py)."""

    def _complete(self, pending: PendingRead, status: int, body: memoryview) -> None:
        """One ANSWER: land it (this thread) and hand the outcome to the event loop."""
        with pending.lock:
            if pending.state == CANCELLED:
                pending.region.release()  # the node is done with it
                return
            pending.state = LANDING
        result: NodeAnswer | KVStoreError
        try:
            if status == frames.TIMED:
                landing_ns = time.monotonic_ns()
                read_start_ns, read_end_ns, table = frames.decode_timed(body)
                result = self._land(pending, table)
                result.node_read_ns = (read_start_ns, read_end_ns)
                result.landed_ns = (landing_ns, time.monotonic_ns())
            elif status == frames.OK:
                result = self._land(pending, body)
            elif status == frames.ERROR:
                code, message = frames.decode_status(body)
                result = from_grpc_status(code_from_value(code), f"node {self.node_id}: {message}")
            elif status == frames.TOO_BIG:
                needed = frames.decode_too_big(body)
                result = RegionTooSmall(f"node {self.node_id}: answer needs {needed} bytes")
            else:
                result = Unavailable(f"node {self.node_id}: read cancelled")
        except ValueError as exc:
            result = BadReply(f"node {self.node_id} sent a malformed local answer: {exc}")
        if not isinstance(result, NodeAnswer):
            pending.region.release()
        _resolve(pending, result)

    def _land(self, pending: PendingRead, table: memoryview) -> NodeAnswer:
        """The answer's payloads where they belong: placed ones are in the pool already;
        copy each streamed one to its place (see the module doc)."""
        entries, payload_bytes = batch_answer.decode_table(table, pending.num_keys)
        region = pending.region
        if payload_bytes > len(region.view):
            raise ValueError(f"{payload_bytes} payload bytes for a {len(region.view)}-byte region")
        hits = entries[entries["status"] == batch_answer.HIT]
        placed = hits["placed"] != 0
        in_place = placed.tolist()
        payloads = _Payloads(
            self.pool, self._placed_starts(pending, hits, placed), hits["payload_len"]
        )
        streamed = (~placed).nonzero()[0].tolist()
        scratch = [region]
        if streamed:
            tails: list[tuple[int, memoryview]] = []
            if pending.received_in_place is None:
                wanted, outs, k = pending.wanted, pending.outs, self._codec.k
                destinations = landing_regions(entries, wanted, outs, k, tails=tails)
                received = False
            else:  # the stream link received them where they belong already
                destinations, tails = pending.received_in_place
                received = True
            sources, targets, sizes = [], [], []
            source, start = self.arena.address + region.offset, 0
            sizes_all = hits["payload_bytes"].tolist()
            for row in streamed:
                size, destination = sizes_all[row], destinations[row]
                if destination is not None and not received:
                    sources.append(source + start)
                    targets.append(_address(destination))
                    sizes.append(size)
                in_place[row] = destination is not None
                payloads.streamed[row] = (
                    destination if destination is not None else region.view[start : start + size]
                )
                start += size
            if sizes:
                fastsum.copy_many(sources, targets, sizes)
        if all(in_place):  # nothing stays in the region: it is free again now
            region.release()
            scratch = []
        elif streamed:
            fill_tails(tails, payloads, in_place)
        return NodeAnswer(entries, payloads, in_place, scratch)

    def _placed_starts(
        self, pending: PendingRead, hits: np.ndarray, placed: np.ndarray
    ) -> np.ndarray:
        """Per HIT row, where its payload starts in the pool (-1: not placed): the range of
        its key's place for its shard, checked for the whole answer at once (a node that
        placed any other shard there answered against its own request: refused)."""
        starts = np.full(len(hits), -1, np.int64)
        rows = placed.nonzero()[0]
        if not len(rows):
            return starts
        if pending.places is None or self.pool is None:
            raise ValueError("the node placed payloads in a READ that named no places")
        mine = hits[rows]
        place = pending.places[mine["key_index"]]
        payload = mine["payload_len"].astype(np.uint64)
        index = mine["shard_index"].astype(np.uint64)
        fits = (
            (place["offset"] != landing.NO_PLACE)
            & (place["shard_index"] == mine["shard_index"])
            & (place["payload_bytes"] == mine["payload_len"])
            & (payload > 0)
            & ((index + 1) * payload <= place["capacity_bytes"])
        )
        if not fits.all():
            raise ValueError("the node placed a shard where its request had no place for it")
        starts[rows] = place["offset"] + index * payload
        return starts


def await_welcome(node_id: str, sock: socket.socket | StreamSocket) -> None:
    """The node's answer to HELLO: return on WELCOME; raise its refusal as its kvstore.errors
    exception, Unavailable for anything else."""
    received = frames.recv_frame(sock, bytearray(frames.HEAD_BYTES))  # type: ignore[arg-type]
    if received is None:
        raise Unavailable(f"node {node_id} closed the connection at HELLO")
    kind, body = received
    if kind == frames.REFUSED:
        code, message = frames.decode_status(body)
        raise from_grpc_status(code_from_value(code), f"node {node_id}: {message}")
    if kind != frames.WELCOME:
        raise Unavailable(f"node {node_id} answered HELLO with frame kind {kind}")


# The event loop sends its READ frames through libc with the GIL held (ctypes.PyDLL): the
# send never blocks (MSG_DONTWAIT) and takes a microsecond, while socket.send releases the
# GIL and must win it back from the receiver threads, which cost the loop about 0.8 ms per
# send in a cProfile of 4 MiB batch reads on the 2-core machine.
_libc = ctypes.PyDLL(None, use_errno=True)
_libc.send.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
_libc.send.restype = ctypes.c_ssize_t
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


def send_holding_gil(fd: int, data: bytes) -> None:
    """Send all of ``data`` at once on a socket, without blocking; OSError otherwise."""
    sent = _libc.send(fd, data, len(data), _SEND_FLAGS)
    if sent < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    if sent != len(data):
        raise BlockingIOError("partial send")


class _Payloads(Sequence[memoryview]):
    """Per HIT row of an answer, its payload: a view of the pool made when asked (a healthy
    read asks for none: its blocks are checked whole), or the streamed payload's view."""

    def __init__(self, pool: LandingPool | None, starts: np.ndarray, sizes: np.ndarray) -> None:
        self._pool, self._starts, self._sizes = pool, starts, sizes  # starts: -1 if not placed
        self.streamed: dict[int, memoryview] = {}

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, row: int) -> memoryview: ...
    @overload
    def __getitem__(self, row: slice) -> Sequence[memoryview]: ...
    def __getitem__(self, row: int | slice) -> memoryview | Sequence[memoryview]:
        if isinstance(row, slice):
            return [self[i] for i in range(len(self))[row]]
        if row in self.streamed:
            return self.streamed[row]
        start = int(self._starts[row])
        if start < 0 or self._pool is None:
            return memoryview(b"")
        return self._pool.memory[start : start + int(self._sizes[row])]


def _resolve(pending: PendingRead, result: NodeAnswer | KVStoreError) -> None:
    pending.loop.call_soon_threadsafe(_set, pending.future, result)


def _set(future: asyncio.Future[NodeAnswer], result: NodeAnswer | KVStoreError) -> None:
    if future.done():
        if isinstance(result, NodeAnswer):
            result.release()
        return
    if isinstance(result, NodeAnswer):
        future.set_result(result)
    else:
        future.set_exception(result)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _check_peer(node_id: str, socket_name: str, sock: socket.socket, node_pid: int) -> None:
    """Unavailable unless process ``node_pid`` (the node's, from its Health reply) listens on
    ``sock``'s other end. A node that gave no pid (0) or one in another pid namespace (the
    kernel then names no pid, or another) gets no local link either: reads stay on gRPC."""
    peer_pid = _peer_pid(sock)
    if node_pid > 0 and peer_pid == node_pid:
        return
    log.warning(
        "node %s: local socket %s is held by pid %d, not by the node's process %d (its Health "
        "reply): another process took the name, or the node runs in another pid namespace; "
        "no token sent, reads stay on gRPC",
        node_id,
        socket_name,
        peer_pid,
        node_pid,
    )
    raise Unavailable(
        f"node {node_id}: local socket {socket_name} is held by pid {peer_pid}, not the "
        f"node's process {node_pid}"
    )


def _peer_pid(sock: socket.socket) -> int:
    """The node process at the other end of a Unix socket (0 if the kernel does not say)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0
    return struct.unpack("3i", creds)[0]


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (True when unknown: assume the worst)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
