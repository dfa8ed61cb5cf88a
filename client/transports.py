"""``NodeTransports``: each node's gRPC connection and the transport its reads travel by.

Every node gets a :class:`~client.node_conn.NodeConn` (gRPC: writes, control calls, and reads
unless another transport serves them). ``start`` then gives the nodes the read transport a
client's ``transport`` asks for (``KVClient.connect`` documents the choices):

    "grpc"   every read over the NodeConn
    "ucx"    UCX to every node that offers an address this client reaches (client/ucx/);
             Unavailable at start when none does or ucxx is missing
    "local"  a local socket and shared memory to every node on this host (client/local/);
             Unavailable at start when none offers one
    "stream" the local channel's frames over TCP (TLS when the cluster's is on) to every
             node that offers a stream port (client/stream/); Unavailable at start when
             none does
    "auto"   local where the node is on this host (linked at start), UCX where shared
             memory, CMA or RDMA reach the node (never TCP), the stream channel to the
             rest (between hosts: one copy into the client, no per-shard Python), gRPC
             where a node offers none of these

Each transport falls back to the one below it per read, so results are identical whatever
was picked. This module assembles the transports; the client only reads ``readers``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

import grpc

from client.landing_pool import LandingPool
from client.local.reader import LocalReader, LocalReads
from client.node_conn import NodeConn, NodeReader
from client.stream.reader import StreamReads
from client.ucx.reader import UcxReader, UcxReads
from client.ucx.transport import UcxTransport
from erasure.codec import Codec
from kvstore.config import ClusterConfig
from kvstore.errors import Unavailable
from kvstore.wire.ucx_worker import INSTALL_HINT, ucx_available

AUTO_LINK_WAIT_S = 2.0  # "auto": how long connect waits for a node's Health before linking it


class NodeTransports:
    """The connections of one client, one per node in the order nodes were first seen."""

    def __init__(
        self,
        codec: Codec,
        tenant: str,
        token: str | None,
        credentials: grpc.ChannelCredentials | None,
        landing_pool: LandingPool | None = None,
        stream_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.codec = codec
        self.tenant = tenant
        self.landing_pool = landing_pool  # shared with every local node (client/local/)
        self._token, self._credentials, self._stream_tls = token, credentials, stream_tls
        self.conns: dict[str, NodeConn] = {}
        self.conn_list: list[NodeConn] = []
        # The read transport of each node, in conn_list order: gRPC, UCX, local or stream
        # (start()).
        self.readers: list[NodeReader] = []
        self.ucx: UcxReads | None = None  # the UCX read path, when start() enabled it
        self.local: LocalReads | None = None  # the local read path (same-host nodes)
        self.stream: StreamReads | None = None  # the stream read path (nodes elsewhere)

    def add_nodes(self, config: ClusterConfig) -> None:
        """A connection to every node of ``config`` not connected yet (a map epoch adds
        nodes; the ones already known keep theirs)."""
        for node in config.nodes:
            if node.id not in self.conns:
                conn = NodeConn(node, self.tenant, self._token, config.codec.k, self._credentials)
                self.conns[node.id] = conn
                self.conn_list.append(conn)
                # A node that joins later is read locally when it is on this host, else
                # over the stream channel when that is on (its Health is asked in the
                # background), else over gRPC.
                reader: NodeReader = conn
                for reads in (self.stream, self.local):
                    if reads is not None:
                        reader = reads.reader(conn, reader)
                self.readers.append(reader)

    async def start(self, transport: str, config: ClusterConfig) -> None:
        """Give nodes the read transports ``transport`` asks for (see the module doc)."""
        fallbacks: list[NodeReader] = list(self.conn_list)
        if transport in ("stream", "auto"):
            fallbacks = await self._start_stream(config, forced=transport == "stream")
        if transport in ("ucx", "auto"):
            fallbacks = await self._start_ucx(config, fallbacks, forced=transport == "ucx")
        if transport in ("local", "auto"):
            await self._start_local(config, fallbacks, forced=transport == "local")
        else:
            self.readers = fallbacks

    async def _start_local(
        self, config: ClusterConfig, fallbacks: list[NodeReader], *, forced: bool
    ) -> None:
        """Every node gets a local reader over its fallback; with ``forced`` ("local") the
        links are made now and at least one must work, else in the background."""
        arena_bytes = 4 * min(n.max_batch_bytes for n in config.nodes)
        self.local = LocalReads(
            self.codec, self.tenant, self._token, arena_bytes, self.landing_pool
        )
        readers = [
            self.local.reader(conn, fallback)
            for conn, fallback in zip(self.conn_list, fallbacks, strict=True)
        ]
        self.readers = list(readers)
        if not forced:
            # "auto": link the nodes on this host now, so the first reads are local already;
            # a node that does not answer in time is linked in the background later.
            await asyncio.gather(*(reader.observe_quietly(AUTO_LINK_WAIT_S) for reader in readers))
            return
        await _require_one_usable(
            readers,
            config.client.timeout_s,
            "transport='local' but no node offered a local socket on this host (nodes "
            "down, on other hosts, in another network namespace, or started with "
            "local_reads='off'); use transport='auto' or 'grpc'",
        )

    async def _start_stream(self, config: ClusterConfig, *, forced: bool) -> list[NodeReader]:
        """Every node's stream reader over its gRPC connection, linked now: with ``forced``
        ("stream") every node and at least one must work; for "auto" the nodes not on this
        host (a node that does not answer in time is linked in the background later)."""
        arena_bytes = 4 * min(n.max_batch_bytes for n in config.nodes)
        self.stream = StreamReads(
            self.codec,
            self.tenant,
            self._token,
            arena_bytes,
            self._stream_tls,
            skip_same_host=not forced,
        )
        readers = [self.stream.reader(conn, conn) for conn in self.conn_list]
        if forced:
            await _require_one_usable(
                readers,
                config.client.timeout_s,
                "transport='stream' but no node offered a stream port this client reaches "
                "(nodes down, or started with stream_reads='off'); use transport='auto' or "
                "'grpc'",
            )
        else:  # "auto": link the nodes elsewhere now (the same host's are linked locally)
            await asyncio.gather(*(reader.observe_quietly(AUTO_LINK_WAIT_S) for reader in readers))
        return list(readers)

    async def _start_ucx(
        self, config: ClusterConfig, fallbacks: list[NodeReader], *, forced: bool
    ) -> list[NodeReader]:
        """Every node's UCX read transport over ``fallbacks``; ``fallbacks`` themselves where
        UCX is not installed ("auto")."""
        if not ucx_available():
            if forced:
                raise Unavailable(f"transport='ucx' but ucxx is not installed; {INSTALL_HINT}")
            return fallbacks
        # "auto" uses UCX only where it needs no TCP: shared memory, CMA or RDMA (over TCP the
        # stream channel serves, or gRPC).
        self.ucx = UcxReads(UcxTransport(transports=None if forced else "^tcp"))
        readers = [
            self.ucx.reader(conn, fallback)
            for conn, fallback in zip(self.conn_list, fallbacks, strict=True)
        ]
        if forced:
            # The client's own timeout, not the background asks' 2 s: a loaded machine answers
            # a first Health on a fresh channel slowly, and "ucx" then fails to connect.
            await _require_one_usable(
                readers,
                config.client.timeout_s,
                "transport='ucx' but no node answered with a UCX address this client "
                "reaches (nodes down, started with ucx='off', or without ucxx); use "
                "transport='auto' or 'grpc'",
            )
        return list(readers)

    async def close(self) -> None:
        """Close the local and UCX paths, then every channel (the UCX path's background
        Health asks use the channels)."""
        for reads in (self.local, self.stream):
            if reads is not None:
                await reads.close()
        if self.ucx is not None:
            await self.ucx.close()
        await asyncio.gather(*(conn.close() for conn in self.conns.values()))


async def _require_one_usable(
    readers: Sequence[LocalReader | UcxReader], timeout_s: float, refusal: str
) -> None:
    """Ask every reader's node now (a transport the caller forced) and raise Unavailable with
    ``refusal`` unless at least one can be used."""
    await asyncio.gather(*(reader.observe(timeout_s) for reader in readers))
    if not any(reader.usable() for reader in readers):
        for reader in readers:  # the nodes refused this client's credential a UCX session
            if isinstance(reader, UcxReader) and reader.refused is not None:
                raise reader.refused
        raise Unavailable(refusal)
