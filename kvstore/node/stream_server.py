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
receives each answer's payloads straight into the caller's blocks, a few scattered
``recvmsg_into`` calls per answer (client/stream/link.py; issue 37's numbers are in
docs/data-paths.md). gRPC stays the control plane: Health tells the port.

Security as on gRPC: with the cluster's TLS on, the connection is TLS with the node's own
certificate (which names ``<id>.node.kvstore``, kvstore/tls.py) and, under ``client_certs =
"require"``, a client certificate the cluster's CA signed; the token in HELLO is checked as
on every channel, and again on every READ. With TLS off (loopback only, kvstore/config.py),
plaintext, as gRPC is then.
"""

from __future__ import annotations

import mmap
import socket
import ssl
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
)
from kvstore.wire import batch_answer
from kvstore.wire import local_frames as frames
from kvstore.wire.stream_socket import StreamSocket

HANDSHAKE_TIMEOUT_S = 10.0
MAX_REGION_BYTES = 1 << 30  # a READ's region: what one answer may make the node buffer


@dataclass
class StreamSession(LocalSession):
    """A stream connection's session: the buffer its inline reads land in (grown on demand)."""

    buffer: mmap.mmap | None = field(default=None, repr=False)

    def region(self, num_bytes: int) -> memoryview:
        if self.buffer is None or len(self.buffer) < num_bytes:
            if self.buffer is not None:
                self.buffer.close()
            self.buffer = mmap.mmap(-1, max(num_bytes, mmap.PAGESIZE))
        return memoryview(self.buffer)[:num_bytes]


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

    def _answer(
        self, session: LocalSession, request: frames.ReadRequest, *, inline: bool
    ) -> Answer:
        """The ANSWER frame and then the payloads: read into the connection's buffer (a
        delayed read, off the connection's thread, into one of its own)."""
        assert isinstance(session, StreamSession)
        try:
            if request.places is not None:
                raise InvalidArgument("a stream READ names no places: nothing is shared")
            if not 0 <= request.region_bytes <= MAX_REGION_BYTES:
                raise InvalidArgument(
                    f"a region of {request.region_bytes} bytes exceeds {MAX_REGION_BYTES}"
                )
            if inline:
                region = session.region(request.region_bytes)
            else:
                region = memoryview(mmap.mmap(-1, max(request.region_bytes, 1)))
            started_ns = time.monotonic_ns()
            table = self._read(session, request, region[: request.region_bytes])
        except Exception as exc:
            return (answer_failure(request.request_id, exc),)
        _, payload_bytes = batch_answer.TABLE_HEAD.unpack_from(table)
        if payload_bytes > request.region_bytes:  # never send bytes that were not read
            return (answer_failure(request.request_id, RegionTooSmall(payload_bytes)),)
        answer = frames.encode_timed(request.request_id, started_ns, time.monotonic_ns(), table)
        return (answer, region[:payload_bytes])
