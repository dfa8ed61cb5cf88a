"""A node's stream read transport: the local channel's frames over TCP (and TLS), for nodes
on other hosts, falling back to the node's gRPC connection. The client half of
kvstore/node/stream_server.py.

As the local transport (client/local/reader.py) in everything but how a link is made and
where payloads land: the node's Health reply tells its stream port, the link connects to the
node's address's host there, and every payload comes through the link's own arena (a node on
another host cannot write into this client's landing pool). Fallbacks, deadlines, cancels and
late answers are the local reader's.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable

import numpy as np

from client.landing import Wanted
from client.local.link import LocalLink
from client.local.reader import LocalReader, LocalReads
from client.node_conn import NodeConn, NodeReader
from client.stream.link import StreamLink
from erasure.codec import Codec
from kvstore.proto import kvstore_pb2 as pb


class StreamReads(LocalReads):
    """What every node's stream reader shares (the local path's, plus the TLS context)."""

    def __init__(
        self,
        codec: Codec,
        tenant: str,
        token: str | None,
        arena_bytes: int,
        tls: ssl.SSLContext | None,
        *,
        skip_same_host: bool = False,
    ) -> None:
        super().__init__(codec, tenant, token, arena_bytes)
        self.tls = tls
        # "auto": a node on this host is read over the local channel, not this one.
        self.skip_same_host = skip_same_host

    def reader(self, conn: NodeConn, fallback: NodeReader) -> LocalReader:
        reader = StreamReader(conn, self, fallback)
        self.readers.append(reader)
        return reader


class StreamReader(LocalReader):
    """One node's read transport: the stream channel where it works, else ``fallback``."""

    kind = "stream"

    def _opener(self, reply: pb.HealthReply) -> Callable[[], LocalLink] | None:
        """Over TCP to the node's stream port on its address's host, unless it has none
        (or, for "auto", runs on this host: the local channel serves it)."""
        shared = self._shared
        assert isinstance(shared, StreamReads)
        same_host = bool(reply.local_socket) and reply.boot_id == shared.boot_id
        if not reply.stream_port or (shared.skip_same_host and same_host):
            return None
        return functools.partial(
            StreamLink.open_stream,
            self.node_id,
            self.conn.address.rpartition(":")[0],
            reply.stream_port,
            shared.token,
            shared.tenant,
            shared.arena_bytes,
            shared.codec,
            shared.tls,
        )

    def _places(self, link: LocalLink, wanted: Wanted, outs: object) -> np.ndarray | None:
        return None  # the node shares no memory with this client
