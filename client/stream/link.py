"""One connection to a node's stream read server (kvstore/node/stream_server.py): the local
link's requests, regions and landing (client/local/link.py), over TCP, with each answer's
payloads received from the connection into the request's region.

Per request::

    event loop    take a region of this link's arena, send READ(id, region, keys)
    node          reads the payloads into its own buffer, sends ANSWER(id, table) and them
    receiver      ANSWER -> recv_into the region, the payloads' bytes only (the GIL is let go
    thread          during each recv), then as on the local link: copy each payload to its
                    place in the caller's block while verifying its shard checksum (one
                    native call), the rest stays in the region -> the NodeAnswer to the loop

So the client's Python work is per answer, not per shard or per byte, as locally. A region
stays the client's until its ANSWER and payloads came, so a late answer to a cancelled
request lands only in memory nobody reads. No landing pool: the node cannot write into the
client's memory, so ``places`` are never named.
"""

from __future__ import annotations

import socket
import ssl

from client.local.link import LocalLink, PendingRead
from erasure.codec import Codec
from kvstore.byte_arena import ByteArena
from kvstore.errors import Unavailable
from kvstore.grpc_errors import code_from_value, from_grpc_status
from kvstore.tls import node_server_name
from kvstore.wire import batch_answer
from kvstore.wire import local_frames as frames
from kvstore.wire.stream_socket import StreamSocket

CONNECT_TIMEOUT_S = 5.0
DISCARD_BYTES = 1 << 20


class StreamLink(LocalLink):
    """A connected, authenticated stream read channel to one node. Create with :meth:`open`
    (blocking: call it in a thread); ``close()`` when done."""

    @classmethod
    def open_stream(
        cls,
        node_id: str,
        host: str,
        port: int,
        token: str | None,
        tenant: str,
        arena_bytes: int,
        codec: Codec,
        tls: ssl.SSLContext | None,
    ) -> StreamLink:
        """Connect to ``host``:``port`` (TLS with ``tls``: the certificate must name node
        ``node_id``), send HELLO and wait for WELCOME. Raises the node's refusal as its
        kvstore.errors exception, Unavailable if it cannot connect or the handshake fails."""
        arena = ByteArena(arena_bytes)
        stream: StreamSocket | None = None
        try:
            raw = socket.create_connection((host.strip("[]"), port), timeout=CONNECT_TIMEOUT_S)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wrapped = raw
            if tls is not None:
                wrapped = tls.wrap_socket(raw, server_hostname=node_server_name(node_id))
            wrapped.settimeout(None)
            stream = StreamSocket(wrapped)
            stream.sendall(frames.encode_hello(token, tenant, arena.capacity_bytes))
            received = frames.recv_frame(stream, bytearray(frames.HEAD_BYTES))  # type: ignore[arg-type]
            if received is None:
                raise Unavailable(f"node {node_id} closed the stream connection at HELLO")
            kind, body = received
            if kind == frames.REFUSED:
                code, message = frames.decode_status(body)
                raise from_grpc_status(code_from_value(code), f"node {node_id}: {message}")
            if kind != frames.WELCOME:
                raise Unavailable(f"node {node_id} answered HELLO with frame kind {kind}")
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            if stream is not None:
                stream.close()
            raise Unavailable(f"node {node_id}: stream connection failed: {exc}") from None
        except BaseException:
            if stream is not None:
                stream.close()
            raise
        return cls(node_id, stream, arena, codec, None, node_pid=0)  # type: ignore[arg-type]

    def _send_frame(self, frame: bytes) -> None:
        stream = self._sock
        assert isinstance(stream, StreamSocket)
        if stream.tls:  # OpenSSL's turn under the stream's lock (kvstore/wire/stream_socket.py)
            stream.sendall(frame)
        else:
            super()._send_frame(frame)

    def _receive_payloads(self, pending: PendingRead | None, status: int, body: memoryview) -> None:
        """An OK answer's payloads into its request's region (a request forgotten: drained)."""
        if status not in (frames.OK, frames.TIMED):
            return
        table = frames.decode_timed(body)[2] if status == frames.TIMED else body
        if len(table) < batch_answer.TABLE_HEAD.size:
            raise ValueError(f"stream answer table of {len(table)} bytes has no head")
        _, payload_bytes = batch_answer.TABLE_HEAD.unpack_from(table)
        stream = self._sock
        if pending is None:
            _drain(stream, payload_bytes)
            return
        if payload_bytes > len(pending.region.view):
            raise ValueError(
                f"{payload_bytes} payload bytes for a {len(pending.region.view)}-byte region"
            )
        if not frames.recv_exactly(stream, pending.region.view[:payload_bytes]):  # type: ignore[arg-type]
            raise ValueError("the node closed the stream connection mid-answer")


def _drain(stream: object, num_bytes: int) -> None:
    scratch = memoryview(bytearray(min(num_bytes, DISCARD_BYTES)))
    while num_bytes:
        piece = scratch[: min(num_bytes, len(scratch))]
        if not frames.recv_exactly(stream, piece):  # type: ignore[arg-type]
            raise ValueError("the node closed the stream connection mid-answer")
        num_bytes -= len(piece)
