"""One connection to a node's local read server, with the arena the node writes into.

kvstore/wire/local_frames.py has the exchange. Per request::

    event loop    take a region of the arena, send READ(id, region, keys)      (a few us)
    receiver      ANSWER(id, table) -> for each HIT payload, in this thread:
    thread          copy arena[region + offset] -> its place in the caller's block
                    (client/landing.py; ctypes.memmove, no GIL), verify its shard checksum
                    right there while the bytes are in cache (xxhash, no GIL); payloads
                    with no place (parity, a padded tail, plain get) stay in the region
                  -> the NodeAnswer, with every shard's verified header, to the event loop

So the event loop does no per-byte work: one send and one wake-up per node per batch.

Ownership. A region is the client's until the node answered its request: a cancelled
request (hedging, a deadline) keeps its region until the late ANSWER comes, so a late
payload lands only in memory nobody reads. Landing and cancelling exclude each other
(``PendingRead.lock``): once cancelled, nothing more is written into the caller's buffers; a
cancel that finds the landing under way waits for it (:meth:`LocalLink.abandon`). A lost
connection fails every request in flight, and the link with its arena is dropped: the
node may still be writing into regions of it.
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
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from client.landing import (
    NodeAnswer,
    Wanted,
    checksum_fields,
    landing_regions,
    verify_landed,
)
from erasure import fastsum
from erasure.codec import Codec
from kvstore.byte_arena import ByteArena, Region
from kvstore.errors import BadReply, KVStoreError, Unavailable
from kvstore.grpc_errors import code_from_value, from_grpc_status
from kvstore.wire import batch_answer
from kvstore.wire import local_frames as frames

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
_WAITING, _LANDING, _CANCELLED = 0, 1, 2


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
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: int = _WAITING


class LocalLink:
    """A connected, authenticated local read channel to one node. Create with :meth:`open`
    (blocking: call it in a thread); ``close()`` when done."""

    def __init__(self, node_id: str, sock: socket.socket, arena: ByteArena, codec: Codec) -> None:
        self.node_id = node_id
        self.arena = arena
        self._sock = sock
        self._codec = codec
        self._lock = threading.Lock()
        self._pending: dict[int, PendingRead] = {}
        self._ids = itertools.count(1)
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
    ) -> LocalLink:
        """Connect, send HELLO with a fresh shared arena, and wait for WELCOME.

        Raises the node's refusal as its kvstore.errors exception (PermissionDenied for a
        bad token or a tenant the token may not act for), Unavailable if it cannot connect.
        """
        if not socket_name.startswith("@"):
            raise Unavailable(f"node {node_id}: local socket {socket_name!r} is not abstract")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        arena = ByteArena(arena_bytes, shared=True)
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            sock.connect("\0" + socket_name[1:])
            hello = frames.encode_hello(token, tenant, arena.capacity_bytes)
            fds = array.array("i", [arena.fd]).tobytes()
            sock.sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            received = frames.recv_frame(sock, bytearray(frames.HEAD_BYTES))
            if received is None:
                raise Unavailable(f"node {node_id} closed the local connection at HELLO")
            kind, body = received
            if kind == frames.REFUSED:
                code, message = frames.decode_status(body)
                raise from_grpc_status(code_from_value(code), f"node {node_id}: {message}")
            if kind != frames.WELCOME:
                raise Unavailable(f"node {node_id} answered HELLO with frame kind {kind}")
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
        return cls(node_id, sock, arena, codec)

    def submit(
        self,
        keys: list[bytes],
        version: bytes,
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        region: Region,
    ) -> PendingRead:
        """Send one READ whose payloads go to ``region`` (taken from ``self.arena``); call
        on the event loop. Raises Unavailable if the link is down or the node does not read
        its socket."""
        loop = asyncio.get_running_loop()
        pending = PendingRead(
            next(self._ids), region, wanted, outs, len(keys), loop.create_future(), loop
        )
        with self._lock:
            if not self.alive:
                raise Unavailable(f"node {self.node_id}: local connection lost")
            self._pending[pending.request_id] = pending
        frame = frames.encode_read(
            pending.request_id, region.offset, len(region.view), version, keys
        )
        try:
            send_holding_gil(self._sock.fileno(), frame)
        except OSError as exc:  # BlockingIOError: the node stopped reading its socket
            self._forget(pending)
            self._shut(f"send failed: {exc}")
            raise Unavailable(f"node {self.node_id}: local READ not sent: {exc}") from None
        return pending

    def abandon(self, pending: PendingRead) -> bool:
        """Give up on a request (cancelled, or past its time): nothing of it lands in the
        caller's buffers from now on. Returns True when its landing is already under way:
        then wait for ``pending.future`` before the buffers are touched again."""
        with pending.lock:
            if pending.state == _LANDING:
                return True
            pending.state = _CANCELLED
        # If the send fails the node learns nothing; its late answer is dropped all the same.
        with contextlib.suppress(OSError):
            self._sock.send(frames.encode_cancel(pending.request_id), socket.MSG_DONTWAIT)
        return False

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
                    pending = self._pending.pop(request_id, None)
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

    def _complete(self, pending: PendingRead, status: int, body: memoryview) -> None:
        """One ANSWER: land it (this thread) and hand the outcome to the event loop."""
        with pending.lock:
            if pending.state == _CANCELLED:
                pending.region.release()  # the node is done with it
                return
            pending.state = _LANDING
        result: NodeAnswer | KVStoreError
        try:
            if status == frames.OK:
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
        """Copy each HIT payload to its place and verify it there (see the module doc)."""
        entries, payload_bytes = batch_answer.decode_table(table, pending.num_keys)
        region = pending.region
        if payload_bytes > len(region.view):
            raise ValueError(f"{payload_bytes} payload bytes for a {len(region.view)}-byte region")
        hits = entries["status"] == batch_answer.HIT
        destinations = landing_regions(entries, pending.wanted, pending.outs, self._codec.k)
        sizes = entries["payload_bytes"][hits].tolist()
        payloads: list[memoryview] = []
        sources, targets = [], []
        source, start = self.arena.address + region.offset, 0
        for destination, size in zip(destinations, sizes, strict=True):
            sources.append(source + start)
            if destination is not None:
                targets.append(_address(destination))
                payloads.append(destination)
            else:
                targets.append(0)
                payloads.append(region.view[start : start + size])
            start += size
        if fastsum.NATIVE:  # one call, no GIL: copy and checksum every payload
            fields, checksums = checksum_fields(entries)
            checked = fastsum.copy_verify(sources, targets, sizes, fields, checksums)
            headers = verify_landed(self._codec, entries, payloads, checked)
        else:
            for target, from_address, size in zip(targets, sources, sizes, strict=True):
                if target:
                    ctypes.memmove(target, from_address, size)
            headers = verify_landed(self._codec, entries, payloads)
        in_place = [d is not None for d in destinations]
        scratch = [region]
        if all(in_place):  # nothing stays in the region: it is free again now
            region.release()
            scratch = []
        return NodeAnswer(entries, payloads, in_place, scratch, headers)


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
