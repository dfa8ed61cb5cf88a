"""Node side of the local read channel: a Unix-domain socket, one thread per client connection.

kvstore/wire/local_frames.py has the exchange. This module does the sockets, threads and memory;
what a read means (authentication, the tenant, the store call) is the node's
(:class:`LocalSession`'s callbacks, kvstore/node/local_face.py)::

    accept thread      accept -> a connection thread
    connection thread  HELLO + memfd(s): open_session(token, tenant) -> a LocalSession (else
                       REFUSED); the arena's memfd (and a landing pool's, when the client
                       sent one) mapped once each proved sealed against shrinking
                       READ: read(session, request, arena[region]) -> ANSWER, right here
                             (delayed, with the straggler delay, on the node's event loop)
                       CANCEL: a delayed READ not yet read is answered CANCELLED
                       EOF: the connection ends once its reads finished; the map is dropped

Why a thread per connection, reading inline: a local read is an lmdb snapshot and a preadv
per shard, all of it without the event loop; handing it to the loop and then to the
executor would cost two thread hops per request, which is what this path exists to avoid.
Requests of one connection are answered in order; several clients (connections) are served
in parallel. (Four reader threads per connection measured no faster on the H200 host:
docs/runs/local-channel-h200/README.md, run 3.)

The socket lives in the abstract namespace (``@kvstore-<node id>-<random>``): nothing on disk
to clean up after a crash, and a restarted node gets a fresh name, which clients learn from
Health along with the host's boot id.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from kvstore.byte_arena import SHARED_SEALS
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.grpc_errors import status_code
from kvstore.wire import local_frames as frames
from kvstore.wire.stream_socket import StreamSocket

log = logging.getLogger(__name__)

ACCEPT_BACKLOG = 64


@dataclass
class LocalSession:
    """One authenticated connection: the token and tenant it reads for, and its arena."""

    token: str
    tenant: str
    arena: memoryview | None = None  # the client's memfd, mapped read-write
    pool: memoryview | None = None  # the client's landing pool, when it sent one
    cancelled: set[int] = field(default_factory=set)  # request ids cancelled before read
    arena_address: int = 0  # where the arena is mapped in this process
    pool_address: int = 0  # where the pool is mapped in this process

    def permit_address(self, index: int) -> int:
        """Where permit word ``index`` lies in this process (the arena's first bytes)."""
        assert self.arena_address and index < frames.NUM_PERMITS
        return self.arena_address + 4 * index


# What a connection's frames travel on: the accepted socket, or its TLS wrapping (the stream
# channel's StreamSocket). What a READ is answered with: buffers sent in order, at once.
Connection = socket.socket | StreamSocket
Answer = tuple[bytes | memoryview, ...]

# read(session, request, region) -> the ANSWER body for OK: the batch answer's table, the
# payloads written to the region; raises KVStoreError (answered ERROR) or RegionTooSmall.
ReadHandler = Callable[[LocalSession, frames.ReadRequest, memoryview], bytes]
SessionOpener = Callable[[str, str], LocalSession]


class RegionTooSmall(Exception):
    """The answer's payloads do not fit the request's region; ``payload_bytes`` they need."""

    def __init__(self, payload_bytes: int) -> None:
        super().__init__(f"answer needs {payload_bytes} bytes")
        self.payload_bytes = payload_bytes


class LocalServer:
    """A node's local read server (see the module doc). ``close()`` when the node stops."""

    def __init__(
        self,
        node_id: str,
        open_session: SessionOpener,
        read: ReadHandler,
        *,
        delay_s: float = 0.0,
        loop: asyncio.AbstractEventLoop | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self._open_session, self._read = open_session, read
        self._delay_s, self._loop, self._executor = delay_s, loop, executor
        if delay_s and (loop is None or executor is None):
            raise InvalidArgument("a local server with a straggler delay needs loop and executor")
        self._listener = self._listen(node_id)
        self._listener.listen(ACCEPT_BACKLOG)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._delayed: set[asyncio.Future[None]] = set()
        self._closed = False
        self._accept_thread = threading.Thread(
            target=self._accept_forever, name=f"local-accept-{node_id}", daemon=True
        )
        self._accept_thread.start()

    def _listen(self, node_id: str) -> socket.socket:
        """The bound listening socket (here: a fresh name in the abstract namespace)."""
        self.socket_name = f"@kvstore-{node_id}-{secrets.token_hex(6)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self.socket_name[1:])
        return listener

    def close(self) -> None:
        """Stop accepting, end every connection and wait for the reads in progress."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    async def finish_delayed(self) -> None:
        """Wait for delayed reads still running (call on the node's loop, before the store
        closes)."""
        await asyncio.gather(*self._delayed, return_exceptions=True)

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve_connection, args=(conn,), name="local-conn", daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve_connection(self, accepted: socket.socket) -> None:
        send_lock = threading.Lock()
        session: LocalSession | None = None
        conn: Connection = accepted
        try:
            conn = self._wrap(accepted)
            session = self._handshake(conn)
            if session is None:
                return
            head = bytearray(frames.HEAD_BYTES)
            while (received := frames.recv_frame(conn, head)) is not None:
                kind, body = received
                if kind == frames.READ:
                    self._on_read(conn, send_lock, session, frames.decode_read(bytes(body)))
                elif kind == frames.CANCEL and self._delay_s:
                    # Only a delayed READ can still be waiting: an inline one was answered
                    # before this frame was read.
                    session.cancelled.add(frames.decode_cancel(bytes(body)))
                elif kind != frames.CANCEL:
                    raise InvalidArgument(f"unexpected local frame kind {kind}")
        except (OSError, InvalidArgument) as exc:
            log.info("local connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(accepted)
                self._threads.discard(threading.current_thread())
            conn.close()
            # The mapping goes with the session once the delayed reads let go of it.

    def _wrap(self, conn: socket.socket) -> Connection:
        """The accepted connection as the frames travel on it (here: as it is)."""
        return conn

    def _handshake(self, conn: Connection) -> LocalSession | None:
        """HELLO with the arena's memfd -> a session (WELCOME), or REFUSED and None."""
        assert isinstance(conn, socket.socket)
        head = bytearray(frames.HEAD_BYTES)
        fds: list[int] = []
        try:
            data, fds = _recv_with_fds(conn, frames.MAX_FRAME_BYTES)
            if len(data) < frames.HEAD_BYTES or data[4] != frames.HELLO:
                raise InvalidArgument("a local connection must start with HELLO")
            head[:] = data[: frames.HEAD_BYTES]
            size = int.from_bytes(data[:4], "little")
            body = bytearray(data[frames.HEAD_BYTES :])
            while len(body) < size:
                more = conn.recv(size - len(body))
                if not more:
                    return None
                body += more
            token, tenant, arena_bytes, pool_bytes = frames.decode_hello(bytes(body))
            session = self._open_session(token, tenant)
            if len(fds) != 1 + bool(pool_bytes):
                raise InvalidArgument(
                    f"HELLO must carry the arena's memfd (and the pool's when it announces "
                    f"one), got {len(fds)} descriptors"
                )
            session.arena = _map_arena(fds[0], arena_bytes)
            session.arena_address = ctypes.addressof(ctypes.c_char.from_buffer(session.arena))
            if arena_bytes < frames.PERMIT_AREA_BYTES:
                raise InvalidArgument(
                    f"an arena of {arena_bytes} bytes has no room for the permit words"
                )
            if pool_bytes:
                session.pool = _map_arena(fds[1], pool_bytes, populate=True)
                session.pool_address = ctypes.addressof(ctypes.c_char.from_buffer(session.pool))
        except KVStoreError as exc:
            conn.sendall(frames.encode_refused(status_code(exc).value[0], str(exc)))
            return None
        finally:
            for fd in fds:
                os.close(fd)
        conn.sendall(frames.frame(frames.WELCOME, b""))
        return session

    def _on_read(
        self,
        conn: Connection,
        send_lock: threading.Lock,
        session: LocalSession,
        request: frames.ReadRequest,
    ) -> None:
        if self._delay_s:
            assert self._loop is not None
            future = asyncio.run_coroutine_threadsafe(
                self._read_delayed(conn, send_lock, session, request), self._loop
            )
            wrapped = asyncio.wrap_future(future, loop=self._loop)
            self._loop.call_soon_threadsafe(self._track, wrapped)
            return
        _send(conn, send_lock, self._answer(session, request, inline=True))

    def _track(self, future: asyncio.Future[None]) -> None:
        self._delayed.add(future)
        future.add_done_callback(self._delayed.discard)

    async def _read_delayed(
        self,
        conn: Connection,
        send_lock: threading.Lock,
        session: LocalSession,
        request: frames.ReadRequest,
    ) -> None:
        await asyncio.sleep(self._delay_s)
        if _take_cancel(session, request.request_id):
            answer: Answer = (frames.encode_answer(request.request_id, frames.CANCELLED),)
        else:
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(
                self._executor, partial(self._answer, session, request, inline=False)
            )
        with contextlib.suppress(OSError):  # the client is gone
            _send(conn, send_lock, answer)

    def _answer(
        self, session: LocalSession, request: frames.ReadRequest, *, inline: bool
    ) -> Answer:
        """What one READ is answered with, in order: here the ANSWER frame (the payloads
        land in the session's arena). ``inline``: on the connection's thread."""
        assert session.arena is not None
        start, end = request.region_offset, request.region_offset + request.region_bytes
        try:
            if not 0 <= start <= end <= len(session.arena):
                raise InvalidArgument(
                    f"region [{start}, {end}) lies outside the {len(session.arena)}-byte arena"
                )
            started_ns = time.monotonic_ns()
            table = self._read(session, request, session.arena[start:end])
        except Exception as exc:
            return (answer_failure(request.request_id, exc),)
        return (frames.encode_timed(request.request_id, started_ns, time.monotonic_ns(), table),)


def answer_failure(request_id: int, exc: Exception) -> bytes:
    """The ANSWER frame of a READ whose read raised ``exc``: TOO_BIG or ERROR."""
    if isinstance(exc, RegionTooSmall):
        return frames.encode_too_big(request_id, exc.payload_bytes)
    error = exc if isinstance(exc, KVStoreError) else None
    if error is None:
        log.exception("local read request failed", exc_info=exc)
        error = KVStoreError(f"{type(exc).__name__}: {exc}")  # INTERNAL
    return frames.encode_error(request_id, status_code(error).value[0], str(error))


MAX_CANCELLED_IDS = 1024  # CANCELs kept for READs not seen yet (or answered already)


def _take_cancel(session: LocalSession, request_id: int) -> bool:
    """Whether delayed READ ``request_id`` was cancelled; forgets it, and bounds what a
    connection keeps: a CANCEL that crossed its ANSWER is never taken, and ids only grow."""
    cancelled = request_id in session.cancelled
    session.cancelled.discard(request_id)
    if len(session.cancelled) > MAX_CANCELLED_IDS:
        floor = request_id - MAX_CANCELLED_IDS
        session.cancelled = {i for i in session.cancelled if i > floor}
    return cancelled


def _send(conn: Connection, lock: threading.Lock, answer: Answer) -> None:
    with lock:
        for data in answer:
            conn.sendall(data)


def _recv_with_fds(conn: socket.socket, max_bytes: int) -> tuple[bytes, list[int]]:
    """One recvmsg: its bytes and the file descriptors that came with them."""
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(max_bytes, socket.CMSG_SPACE(2 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _map_arena(fd: int, arena_bytes: int, *, populate: bool = False) -> memoryview:
    """Map a client's arena memfd read-write; InvalidArgument unless it is a sealed memfd of
    the announced size (a shrinkable mapping could fault the node). ``populate``: fault the
    whole mapping in now (a landing pool: otherwise every first write to one of its pages
    from this process takes a page fault on the read path)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise InvalidArgument(f"the arena is not a memfd ({exc}); send ByteArena.shared") from None
    if seals & SHARED_SEALS != SHARED_SEALS:
        raise InvalidArgument("the arena memfd must be sealed against shrinking and growing")
    if not 0 < arena_bytes == size <= frames.MAX_ARENA_BYTES:
        raise InvalidArgument(f"arena of {size} bytes announced as {arena_bytes}")
    try:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return memoryview(mmap.mmap(fd, size, flags=flags))
    except OSError as exc:  # e.g. sealed against writes
        raise InvalidArgument(f"cannot map the arena for writing: {exc}") from None
