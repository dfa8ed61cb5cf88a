"""One connection to a node's stream read server (kvstore/node/stream_server.py): the local
link's requests, regions and landing (client/local/link.py), over TCP, with each answer's
payloads received from the connection.

Per request::

    event loop    take a region of this link's arena, send READ(id, region, keys)
    node          reads the payloads into its own buffer, sends ANSWER(id, table) and them
    receiver      ANSWER -> the payloads straight from the socket to where they belong: a
    thread          data shard with a place in the caller's block there, the rest into the
                    region (scattered ``recvmsg_into`` calls, the GIL let go in each)
                    -> the NodeAnswer to the event loop (as on the local link, the block
                    checksum verifies the bytes: client/batch_read.py)

So a payload is copied once on the client (by the kernel), and the client's Python work is
per answer and per payload's view, not per byte. A region stays the client's until its
ANSWER and payloads came, so a late answer to a cancelled request lands only in memory nobody
reads; the caller's buffers are written only by a receiver that marked the request as landing
first (``PendingRead.lock``), as on the local link. No landing pool: the node cannot write
into the client's memory, so ``places`` are never named.
"""

from __future__ import annotations

import socket
import ssl

from client.landing import landing_regions
from client.local.link import CANCELLED, LANDING, LocalLink, PendingRead, await_welcome
from erasure.codec import Codec
from kvstore.byte_arena import ByteArena
from kvstore.errors import Unavailable
from kvstore.tls import node_server_name
from kvstore.wire import batch_answer
from kvstore.wire import local_frames as frames
from kvstore.wire.stream_socket import StreamSocket

CONNECT_TIMEOUT_S = 5.0
DISCARD_BYTES = 1 << 20
MAX_IOVECS = 1024  # Linux's IOV_MAX


class StreamLink(LocalLink):
    """A connected, authenticated stream read channel to one node. Create with
    :meth:`open_stream` (blocking: call it in a thread); ``close()`` when done."""

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
            await_welcome(node_id, stream)
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
        """An OK answer's payloads: each data shard with a place in the caller's block
        straight there, the rest into the request's region at its offset; a cancelled
        request's all into its region, a forgotten one's drained."""
        if status not in (frames.OK, frames.TIMED):
            return
        table = frames.decode_timed(body)[2] if status == frames.TIMED else body
        if len(table) < batch_answer.TABLE_HEAD.size:
            raise ValueError(f"stream answer table of {len(table)} bytes has no head")
        _, payload_bytes = batch_answer.TABLE_HEAD.unpack_from(table)
        stream = self._sock
        assert isinstance(stream, StreamSocket)
        if pending is None:
            _drain(stream, payload_bytes)
            return
        region = pending.region.view
        if payload_bytes > len(region):
            raise ValueError(f"{payload_bytes} payload bytes for a {len(region)}-byte region")
        views = self._targets(pending, table, region)
        if views is None:
            views = [region[:payload_bytes]]
        _recv_all(stream, views)

    def _targets(
        self, pending: PendingRead, table: memoryview, region: memoryview
    ) -> list[memoryview] | None:
        """Where each payload of the answer goes, in order; None: all into the region (a
        malformed table, which ``_land`` then refuses, or a request already cancelled)."""
        try:
            entries, _ = batch_answer.decode_table(table, pending.num_keys)
        except ValueError:
            return None
        tails: list[tuple[int, memoryview]] = []
        k = self._codec.k
        destinations = landing_regions(entries, pending.wanted, pending.outs, k, tails=tails)
        with pending.lock:  # once cancelled, nothing more lands in the caller's buffers
            if pending.state == CANCELLED:
                return None
            pending.state = LANDING
        pending.received_in_place = destinations, tails
        hits = entries[entries["status"] == batch_answer.HIT]
        views, start = [], 0
        for size, destination in zip(hits["payload_bytes"].tolist(), destinations, strict=True):
            views.append(region[start : start + size] if destination is None else destination)
            start += size
        return views


def _recv_all(stream: StreamSocket, views: list[memoryview]) -> None:
    """Fill every view in order from ``stream``. A plain socket scatters into up to
    ``MAX_IOVECS`` of them per ``recvmsg_into`` with MSG_WAITALL: the kernel returns once
    they are all full, so a receiver takes the GIL back once per answer, not once per socket
    buffer's worth (a signal may cut a call short: the loop goes on). TLS fills one view at
    a time."""
    if stream.tls:
        for view in views:
            if not frames.recv_exactly(stream, view):  # type: ignore[arg-type]
                raise ValueError("the node closed the stream connection mid-answer")
        return
    pending = [view for view in views if len(view)]
    while pending:
        batch = pending[:MAX_IOVECS]
        count = stream.sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if not count:
            raise ValueError("the node closed the stream connection mid-answer")
        done = 0
        while count and count >= len(batch[done]):
            count -= len(batch[done])
            done += 1
        if count:
            batch[done] = batch[done][count:]
        pending = batch[done:] + pending[len(batch) :]


def _drain(stream: object, num_bytes: int) -> None:
    scratch = memoryview(bytearray(min(num_bytes, DISCARD_BYTES)))
    while num_bytes:
        piece = scratch[: min(num_bytes, len(scratch))]
        if not frames.recv_exactly(stream, piece):  # type: ignore[arg-type]
            raise ValueError("the node closed the stream connection mid-answer")
        num_bytes -= len(piece)
