"""Node side of the stream read channel: the local channel's frames over TCP, for clients on
other hosts, with the payloads following each ANSWER on the connection.

The local channel (kvstore/node/local_server.py) writes payloads into the client's memory;
a client on another host shares none, so here the node reads a batch's payloads into a
buffer of its own with the same native read loop, and sends them after the ANSWER frame,
back to back in the table's order::

    client                                              node (one thread per connection)
    [TLS handshake: the node's certificate names it; a client certificate under mTLS]
    HELLO(token, tenant, region bytes)  ------------->  authenticate, derive the tenant
    <-------------------------------------------------  WELCOME, or REFUSED(code, message)
    READ(id, region offset, region bytes, keys)  ---->  one index snapshot, one read loop
                                                        into this connection's buffer
    <-------------------------------------------------  ANSWER(id, OK, table), then the
                                                        table's payload bytes, unframed
    CANCEL(id)  ------------------------------------->  as on the local channel

Why not gRPC for these bytes: a gRPC GET builds a message per answer on both sides and
copies each payload through gRPC's buffers and a Python bytes object; here the client
receives each answer's payloads with one ``recv_into`` loop into its own region (issue 37's
numbers are in docs/data-paths.md). gRPC stays the control plane: Health tells the port.

Security as on gRPC: with the cluster's TLS on, the connection is TLS with the node's own
certificate (which names ``<id>.node.kvstore``, kvstore/tls.py) and, under ``client_certs =
"require"``, a client certificate the cluster's CA signed; the token in HELLO is checked as
on every channel, and again on every READ. With TLS off (loopback only, kvstore/config.py),
plaintext, as gRPC is then.
"""

from __future__ import annotations

import logging
import mmap
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.grpc_errors import status_code
from kvstore.node.local_server import (
    Answer,
    Connection,
    LocalServer,
    LocalSession,
    ReadHandler,
    RegionTooSmall,
    SessionOpener,
    answer_failure,
    send_answer,
)
from kvstore.wire import batch_answer
from kvstore.wire import local_frames as frames
from kvstore.wire.stream_socket import StreamSocket

HANDSHAKE_TIMEOUT_S = 10.0
MAX_REGION_BYTES = 1 << 30
NUM_BUFFERS = 2  # answers read per connection ahead of the one being sent

log = logging.getLogger(__name__)  # a READ's region: what one answer may make the node buffer


class ReadBuffer:
    """Node memory one answer's payloads are read into (grown on demand, kept)."""

    def __init__(self) -> None:
        self._memory: mmap.mmap | None = None

    def region(self, num_bytes: int) -> memoryview:
        if self._memory is None or len(self._memory) < num_bytes:
            if self._memory is not None:
                self._memory.close()
            self._memory = mmap.mmap(-1, max(num_bytes, mmap.PAGESIZE))
        return memoryview(self._memory)[:num_bytes]


@dataclass
class StreamSession(LocalSession):
    """A stream connection's session, and its sender: the connection's thread reads a READ's
    payloads into one of ``NUM_BUFFERS`` buffers while the sender sends the answer before
    it from another, so the disk reads of one answer overlap the sending of the last."""

    free: queue.Queue[ReadBuffer] = field(default_factory=queue.Queue, repr=False)
    outbox: queue.Queue[_Outgoing | None] = field(default_factory=queue.Queue, repr=False)
    sender: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for _ in range(NUM_BUFFERS):
            self.free.put(ReadBuffer())

    def send_later(
        self, conn: Connection, lock: threading.Lock, answer: Answer, buffer: ReadBuffer
    ) -> None:
        if self.sender is None:
            self.sender = threading.Thread(
                target=self._send_forever, name="stream-send", daemon=True
            )
            self.sender.start()
        self.outbox.put(_Outgoing(conn, lock, answer, buffer))

    def finish(self) -> None:
        """Send what is queued (or fail to: the client left), then stop the sender."""
        if self.sender is not None:
            self.outbox.put(None)
            self.sender.join()

    def _send_forever(self) -> None:
        broken = False
        while (item := self.outbox.get()) is not None:
            try:
                if not broken:
                    send_answer(item.conn, item.lock, item.answer)
            except OSError as exc:  # the client is gone: the connection's thread sees EOF
                log.info("stream connection ended while sending: %s", exc)
                broken = True
            finally:
                self.free.put(item.buffer)


@dataclass
class _Outgoing:
    conn: Connection
    lock: threading.Lock
    answer: Answer
    buffer: ReadBuffer


class StreamServer(LocalServer):
    """A node's stream read server on ``host``:``port`` (0: any free one; ``port`` then says
    which). ``tls`` makes the TLS context for a new connection (kvstore/tls.py
    ``stream_server_context``: the certificate files as they are now), or None: plaintext."""

    def __init__(
        self,
        node_id: str,
        host: str,
        port: int,
        open_session: SessionOpener,
        read: ReadHandler,
        tls: Callable[[], ssl.SSLContext | None],
        **kwargs: object,
    ) -> None:
        self._address, self._tls = (host, port), tls
        super().__init__(node_id, open_session, read, **kwargs)  # type: ignore[arg-type]
        self.port = int(self._listener.getsockname()[1])

    def _listen(self, node_id: str) -> socket.socket:
        self.socket_name = ""
        host, port = self._address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
        return listener

    def _wrap(self, conn: socket.socket) -> Connection:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = self._tls()
        if context is None:
            return StreamSocket(conn)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        wrapped = context.wrap_socket(conn, server_side=True)
        wrapped.settimeout(None)
        return StreamSocket(wrapped)

    def _handshake(self, conn: Connection) -> LocalSession | None:
        """HELLO (no memfds: nothing is shared) -> a session (WELCOME), or REFUSED and None."""
        received = frames.recv_frame(conn, bytearray(frames.HEAD_BYTES))  # type: ignore[arg-type]
        if received is None:
            return None
        kind, body = received
        if kind != frames.HELLO:
            raise InvalidArgument("a stream connection must start with HELLO")
        try:
            token, tenant, _, pool_bytes = frames.decode_hello(bytes(body))
            if pool_bytes:
                raise InvalidArgument("a stream connection shares no landing pool")
            opened = self._open_session(token, tenant)
        except KVStoreError as exc:
            conn.sendall(frames.encode_refused(status_code(exc).value[0], str(exc)))
            return None
        conn.sendall(frames.frame(frames.WELCOME, b""))
        return StreamSession(opened.token, opened.tenant)

    def _on_read(
        self,
        conn: Connection,
        send_lock: threading.Lock,
        session: LocalSession,
        request: frames.ReadRequest,
    ) -> None:
        """Read into a free buffer here, and let the session's sender send the answer."""
        if self._delay_s:
            super()._on_read(conn, send_lock, session, request)
            return
        assert isinstance(session, StreamSession)
        buffer = session.free.get()  # at most NUM_BUFFERS answers read ahead of the socket
        answer = self._answer_into(session, request, buffer)
        session.send_later(conn, send_lock, answer, buffer)

    def _end_session(self, session: LocalSession) -> None:
        assert isinstance(session, StreamSession)
        session.finish()

    def _answer(
        self, session: LocalSession, request: frames.ReadRequest, *, inline: bool
    ) -> Answer:
        """A delayed read's answer (off the connection's thread), in a buffer of its own."""
        return self._answer_into(session, request, ReadBuffer())

    def _answer_into(
        self, session: LocalSession, request: frames.ReadRequest, buffer: ReadBuffer
    ) -> Answer:
        """The ANSWER frame and then the payloads, read into ``buffer``."""
        try:
            if request.places is not None:
                raise InvalidArgument("a stream READ names no places: nothing is shared")
            if not 0 <= request.region_bytes <= MAX_REGION_BYTES:
                raise InvalidArgument(
                    f"a region of {request.region_bytes} bytes exceeds {MAX_REGION_BYTES}"
                )
            region = buffer.region(request.region_bytes)
            started_ns = time.monotonic_ns()
            table = self._read(session, request, region[: request.region_bytes])
        except Exception as exc:
            return (answer_failure(request.request_id, exc),)
        _, payload_bytes = batch_answer.TABLE_HEAD.unpack_from(table)
        if payload_bytes > request.region_bytes:  # never send bytes that were not read
            return (answer_failure(request.request_id, RegionTooSmall(payload_bytes)),)
        answer = frames.encode_timed(request.request_id, started_ns, time.monotonic_ns(), table)
        return (answer, region[:payload_bytes])
