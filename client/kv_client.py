"""``KVClient``: the asyncio client of a kvstore cluster.

::

    kv = await KVClient.connect("DIR/cluster.toml", tenant="acme", token=None)
    async with KVClient.connect(...) as kv: ...          # or: async with await ...connect(...)
    await kv.put(key, data, traffic_class="chat", ttl_s=None)  # QuorumError below k stored
    await kv.get(key) -> bytes | None                    # None is a miss
    await kv.get(key, on_timeout="raise")                # a timeout raises Timeout instead
    await kv.get_batch(keys, outcomes=True) -> BatchResult  # per key HIT, MISS or TIMEOUT
    await kv.get_into(key, out) -> bool                  # decodes straight into ``out``
    await kv.contains(keys) -> list[bool]
    await kv.match_prefix(keys) -> int
    await kv.delete(keys); await kv.close()
    await kv.get_batch_into(keys, buffers) -> list[bool]  # the data plane (below)
    await kv.get_batch(keys) -> list[bytes | None]
    await kv.put_batch(keys, blocks, traffic_class="chat", ttl_s=None)  # QuorumError: keys

A key is 16 bytes (``block_keys``) or a ``str``, hashed by ``client.keys.string_key`` exactly
as ``kvstore get|put|del|ttl|inspect`` hash it. A block (a put's data, a ``get_into``
destination) is any contiguous buffer: bytes, bytearray, memoryview, a numpy array, or a CPU
tensor (torch's included, found by duck typing: client/buffers.py; torch is never imported
here). ``ttl_s`` gives the blocks a TTL of their own, used instead of their class's when
shorter: the nodes never keep a block longer than its class TTL or its tenant's cap.

The batch calls are the data plane: one request per node per batch (client/batch_read.py,
client/write_path.py), shard payloads landing straight in the caller's buffers. The
single-key calls are batches of one. ``KVClient`` is a façade over its map, connections and
counters: the reads (client/block_reads.py), the writes (client/block_writes.py) and the key
commands (client/key_ops.py) are collaborators it composes.

What a caller sees: ``get`` returns the exact bytes some ``put`` of that key stored, or None
(a miss, fewer than k reachable shards of one version, or the deadline passed: tell the last
apart with ``on_timeout="raise"`` or ``outcomes=True``, client/read_outcome.py); never a mix
of two writers' bytes and never bytes that fail the block checksum. Misuse (a key that is not 16
bytes, an oversized block, an unknown traffic class, a ``get_into`` buffer of the wrong size, a
bad token) raises a kvstore.errors exception. ``contains`` and ``match_prefix`` send one
batched RPC per node per call and do not refresh TTLs; a ``get`` hit does, on every shard of
the block (the nodes that did not serve it get a batched touch, client/follow_ups.py).

Writes return at ``write_quorum`` (11) shards, or ``hedge_delay_s`` after ``min_write_shards``
(k) were stored: a put with two nodes of the group down succeeds, and the group's repair
leader is told to rebuild the missing shards (kvstore/node/repair_service.py). Every shard carries
the client's write time, by which the nodes keep a key's newest version only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Generator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, overload

from client.batch_read import OnLanded, ReadCounters, ReadTimes
from client.block_reads import BlockReads, Landing
from client.block_writes import BlockWrites
from client.buffers import Buffer
from client.follow_ups import FollowUps
from client.integrity import BlockIntegrity, tenant_key
from client.key_ops import KeyOps
from client.keyring import open_keyring
from client.landing_pool import LandingPool
from client.local.reader import LocalReads
from client.map_follower import MapFollower
from client.node_conn import NodeConn, NodeReader
from client.read_outcome import BatchResult
from client.read_timeline import ReadTimeline
from client.sealer import BlockSealer
from client.stream.reader import StreamReads
from client.transports import NodeTransports
from client.ucx.reader import UcxReads
from client.write_path import WriteCounters
from erasure.codec import make_codec
from kvstore.auth import client_token
from kvstore.config import READ_TRANSPORTS, ClusterConfig, load_cluster
from kvstore.errors import InvalidArgument
from kvstore.placement import Placement
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tls import channel_credentials, stream_client_context
from ttl.clock import Clock, make_clock

__all__ = ["TRANSPORTS", "Buffer", "KVClient", "Key", "Landing"]

Key = bytes | str  # 16 bytes, or a str hashed by client.keys.string_key
TRANSPORTS = READ_TRANSPORTS


class KVClient:
    """Client of one cluster for one tenant. Create with :meth:`connect`."""

    def __init__(
        self,
        config: ClusterConfig,
        tenant: str,
        token: str | None,
        *,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        landing_pool: LandingPool | None = None,
    ) -> None:
        if not tenant:
            raise InvalidArgument("tenant must be a non-empty string, e.g. tenant='acme'")
        try:
            token = client_token(token)
            credentials = channel_credentials(config, tls_cert_file, tls_key_file)
            stream_tls = stream_client_context(config, tls_cert_file, tls_key_file)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self.config = config
        self.tenant = tenant
        self.codec = make_codec(config.codec)
        self.clock: Clock = make_clock(config.ttl.time_scale, config.ttl.origin_unix_s)
        self.placement = Placement(config)
        # Buffers in this pool land in place: local nodes write their shards there.
        self.landing_pool = landing_pool
        # Each node's connection and read transport (client/transports.py).
        self.transports = NodeTransports(
            self.codec, tenant, token, credentials, landing_pool, stream_tls
        )
        self._place(config)
        self.read_counters = ReadCounters()
        self.read_times = ReadTimes()
        # Set a ReadTimeline here to record where batch reads spend their time (benchmarks).
        self.timeline: ReadTimeline | None = None
        self.write_counters = WriteCounters()
        # Touches after read hits, repair hints after short reads and writes (background).
        self.follow_ups = FollowUps(self.conns, config.groups, tenant, config.client.timeout_s)
        # The commands, each a collaborator over this client's current map.
        self.reads = BlockReads(self)
        self.writes = BlockWrites(self)
        self.key_ops = KeyOps(self)
        # Encryption at rest for this tenant ([encryption] in cluster.toml): blocks are sealed
        # before erasure coding and opened after decoding (client/sealer.py).
        self.sealer: BlockSealer | None = None
        if config.encryption.covers(tenant):
            try:
                self.sealer = BlockSealer(tenant, open_keyring(config.encryption))
            except (OSError, ValueError) as exc:
                raise InvalidArgument(f"[encryption] of tenant {tenant!r}: {exc}") from None
        # End-to-end integrity ([integrity] in cluster.toml): keyed block versions that only
        # this tenant's clients can compute (client/integrity.py); sealed tenants have GCM.
        self.integrity: BlockIntegrity | None = None
        if config.integrity.key_file and self.sealer is None:
            key = tenant_key(config.integrity.key_file, tenant)
            self.integrity = BlockIntegrity(tenant, key)
        self._closed = False
        self._map_follower: MapFollower | None = None  # set by connect()

    @property
    def conns(self) -> dict[str, NodeConn]:
        """Node id -> its gRPC connection."""
        return self.transports.conns

    @property
    def conn_list(self) -> list[NodeConn]:
        """The connections as a list, in ``conns`` order (node index -> connection)."""
        return self.transports.conn_list

    @property
    def readers(self) -> list[NodeReader]:
        """The read transport of each node, in ``conns`` order: gRPC, UCX, local or stream."""
        return self.transports.readers

    @property
    def ucx(self) -> UcxReads | None:
        """The UCX read path, when connect() enabled it."""
        return self.transports.ucx

    @property
    def local(self) -> LocalReads | None:
        """The local read path (same-host nodes), when connect() enabled it."""
        return self.transports.local

    @property
    def stream(self) -> StreamReads | None:
        """The stream read path (the local frames over TCP), when connect() enabled it."""
        return self.transports.stream

    def _place(self, config: ClusterConfig) -> None:
        """Channels to every node of ``config`` (kept for nodes already known) and its groups
        as node indexes: ``groups`` for writes and first reads, ``moving_from`` (during a map
        change) for the reads that miss."""
        self.transports.add_nodes(config)
        node_index = {node_id: i for i, node_id in enumerate(self.conns)}
        self.group_members = [[node_index[n] for n in group] for group in config.groups]
        self.previous_members = [[node_index[n] for n in g] for g in config.moving_from]

    @property
    def map_stale(self) -> bool:
        """Whether the map in use may be behind etcd's: the client started on the cached map
        while etcd was down, or etcd stopped answering (client/map_follower.py)."""
        return self._map_follower is not None and self._map_follower.stale

    def apply_map(self, config: ClusterConfig) -> None:
        """Switch to a newer cluster map epoch (etcd membership) without reconnecting."""
        if config.epoch <= self.config.epoch:
            return
        self._place(config)
        self.config = config
        self.placement = Placement(config)
        self.follow_ups.set_groups(config.groups)
        for conn in self.conn_list:  # a node back in the map is dialed now, not after backoff
            conn.redial()

    @classmethod
    def connect(
        cls,
        cluster_toml: str | Path | ClusterConfig,
        tenant: str,
        token: str | None = None,
        *,
        transport: str = "grpc",
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        landing_pool: LandingPool | None = None,
    ) -> _Connecting:
        """Open a client: ``await KVClient.connect(...)`` or ``async with KVClient.connect(...)``.

        ``token`` is this client's credential (kvstore/auth.py): None reads ``$KVSTORE_TOKEN``
        or the file named by ``$KVSTORE_TOKEN_FILE`` (never cluster.toml). The nodes derive
        the tenant from it: a tenant token works only for its own ``tenant``, a service token
        for the tenants of its allow-list. With TLS on, ``tls_cert_file``/``tls_key_file``
        (or ``$KVSTORE_TLS_CERT``/``$KVSTORE_TLS_KEY``) are the client certificate for mutual
        TLS.

        With ``[membership] etcd`` set, the map is etcd's and the client follows its epochs
        without reconnecting (kvstore/membership.py; during a move reads that miss ask the
        placement before it). While etcd does not answer, the client starts on the last map
        read from it (cached beside cluster.toml) or the file's, and :attr:`map_stale` says so
        until etcd answers. Channels connect lazily; a node that is down only shows up as a
        failed RPC later.
        ``transport`` picks how reads travel (client/transports.py): "grpc"; "ucx"
        (Unavailable at connect unless ucxx is installed and some node answers with a UCX
        address this client reaches); "local" (shared memory with the nodes on this host);
        "stream" (the local channel's frames over TCP, TLS when the cluster's is on: one
        copy into the client per payload); "auto" = local to the nodes on this host, UCX to
        each node a shared-memory/RDMA UCX worker reaches, the stream channel to the rest
        (learned at connect and in the background), gRPC where none works. Results are
        identical.
        The default is "grpc": on the 2-core machine we measure on, with 12 nodes sharing the
        cores, the UCX path was slower at every block size (docs/data-paths.md).

        ``landing_pool`` (client/landing_pool.py): buffers in it land in place over the local
        channel: each local node writes its data shard straight to its place in the block,
        and the client copies nothing (the engine's swap-in pool is one).
        """
        if transport not in TRANSPORTS:
            raise InvalidArgument(
                f"transport {transport!r} is not one of {TRANSPORTS}; 'auto' picks per node"
            )
        open_client = partial(
            cls._open,
            cluster_toml,
            tenant,
            token,
            transport,
            tls_cert_file,
            tls_key_file,
            landing_pool,
        )
        return _Connecting(open_client)

    @classmethod
    async def _open(
        cls,
        cluster_toml: str | Path | ClusterConfig,
        tenant: str,
        token: str | None,
        transport: str,
        tls_cert_file: str | None,
        tls_key_file: str | None,
        landing_pool: LandingPool | None,
    ) -> KVClient:
        """:meth:`connect`'s steps: the map (etcd's when set), the client, then its map
        follower and read transports."""
        config = await _load_config(cluster_toml)
        source = None if isinstance(cluster_toml, ClusterConfig) else cluster_toml
        follower = MapFollower(config, source)
        try:
            config = await follower.current_map(config)
            client = cls(
                config,
                tenant,
                token,
                tls_cert_file=tls_cert_file,
                tls_key_file=tls_key_file,
                landing_pool=landing_pool,
            )
        except BaseException:
            await follower.close()
            raise
        client._map_follower = follower
        follower.start(config.epoch, client.apply_map)
        await client._start_transports(transport)
        return client

    async def _start_transports(self, transport: str) -> None:
        """The read transports ``transport`` asks for (client/transports.py); a client that
        cannot get them is closed."""
        if transport == "grpc":
            return
        try:
            await self.transports.start(transport, self.config)
        except BaseException:
            await self.close()
            raise

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def resolve_timeout_s(self, timeout_s: float | None) -> float:
        """A call's timeout: its own, else the cluster's ``[client] timeout_s``."""
        return self.config.client.timeout_s if timeout_s is None else timeout_s

    async def put(
        self,
        key: Key,
        data: Buffer,
        traffic_class: str = "chat",
        *,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Store ``data`` under ``key``; QuorumError if fewer than min_write_shards (k) land."""
        await self.put_batch(
            [key], [data], traffic_class=traffic_class, ttl_s=ttl_s, timeout_s=timeout_s
        )

    async def put_batch(
        self,
        keys: Sequence[Key],
        blocks: Sequence[Buffer],
        *,
        traffic_class: str,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Store ``blocks[i]`` under ``keys[i]``: one PutShards per node for the whole batch.

        Stores every block it can. Raises QuorumError naming the keys (also as its ``keys``
        attribute) whose blocks reached fewer than min_write_shards nodes; the other blocks
        are stored. Misuse (bad key, unknown class, oversized block, a TTL not above 0) raises
        before anything is sent. A block stored with fewer than k+m shards is hinted to repair.
        ``ttl_s``: the blocks' own TTL (seconds of the cluster clock), used instead of the
        class TTL when shorter; None = the class's (within the tenant's cap, as always).
        """
        await self.writes.put_batch(keys, blocks, traffic_class, ttl_s, timeout_s)

    async def get(
        self, key: Key, *, timeout_s: float | None = None, on_timeout: str = "miss"
    ) -> bytes | None:
        """The block stored under ``key``, or None (a miss, too few shards). A deadline that
        passed first reads as None too, or raises kvstore.errors.Timeout with
        ``on_timeout="raise"`` (client/read_outcome.py)."""
        (block,) = await self.get_batch([key], timeout_s=timeout_s, on_timeout=on_timeout)
        return block

    async def get_into(
        self, key: Key, out: Buffer, *, timeout_s: float | None = None, on_timeout: str = "miss"
    ) -> bool:
        """Decode the block straight into ``out`` (writable, exactly the block's size).

        Returns False on a miss (``out`` may then hold partial data). Raises InvalidArgument
        when ``out`` is read-only or its size differs from the stored block's; a timeout as
        :meth:`get` says.
        """
        (landed,) = await self.get_batch_into(
            [key], [out], timeout_s=timeout_s, on_timeout=on_timeout
        )
        return landed

    @overload
    async def get_batch(
        self,
        keys: Sequence[Key],
        *,
        timeout_s: float | None = None,
        on_timeout: str = "miss",
        outcomes: Literal[False] = False,
    ) -> list[bytes | None]: ...

    @overload
    async def get_batch(
        self,
        keys: Sequence[Key],
        *,
        timeout_s: float | None = None,
        on_timeout: str = "miss",
        outcomes: Literal[True],
    ) -> BatchResult: ...

    async def get_batch(
        self,
        keys: Sequence[Key],
        *,
        timeout_s: float | None = None,
        on_timeout: str = "miss",
        outcomes: bool = False,
    ) -> list[bytes | None] | BatchResult:
        """Each key's block, or None (a miss): one request per node for the whole batch.

        ``outcomes=True`` returns a BatchResult: the blocks and, per key, HIT, MISS or TIMEOUT
        (the deadline passed before the key was decided). ``on_timeout="raise"`` raises
        kvstore.errors.Timeout instead when any key timed out (client/read_outcome.py).
        """
        return await self.reads.get_batch(keys, timeout_s, on_timeout, outcomes)

    async def get_batch_into(
        self,
        keys: Sequence[Key],
        buffers: Sequence[Buffer],
        *,
        timeout_s: float | None = None,
        on_timeout: str = "miss",
    ) -> list[bool]:
        """Land each key's block in its buffer: True = it landed and was verified, False = a
        miss (that buffer may then hold partial data); a timeout as :meth:`get_batch` says.

        Each buffer must be writable and exactly its block's size (InvalidArgument
        otherwise). Shard payloads land straight at their place in the buffers; a buffer
        from a long-lived pool (client/buffer_pool.py) is registered with UCX once, and one
        in the client's landing pool is written by the local nodes themselves.
        """
        landing = await self.land_batch(keys, buffers, timeout_s=timeout_s, on_timeout=on_timeout)
        return landing.landed

    async def land_batch(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        on_landed: OnLanded | None = None,
        timeout_s: float | None = None,
        on_timeout: str = "miss",
    ) -> Landing:
        """:meth:`get_batch_into` for engines that use blocks while they arrive.

        ``on_landed(pairs)`` is called on the event loop as node answers come in, with the
        (batch position, data shard index) of every data shard that is now at its place in
        its buffer (bytes ``[i*P, (i+1)*P)``, P = ceil(block bytes / k)); an engine may copy
        those bytes onward at once (client/readiness.py turns shards into layers). They are
        not verified yet: the returned :class:`Landing` says which blocks were (``landed``)
        and which had bytes written again after they were announced (``rewritten``: a shard
        recovered from parity or replaced after a failed check); copy those again. A timeout
        as :meth:`get_batch` says.
        """
        return await self.reads.land_batch(keys, buffers, on_landed, timeout_s, on_timeout)

    async def contains(self, keys: Sequence[Key], *, timeout_s: float | None = None) -> list[bool]:
        """For each key: is its block readable (some version on >= k nodes)? TTLs not refreshed."""
        return await self.key_ops.contains(keys, timeout_s)

    async def match_prefix(self, keys: Sequence[Key], *, timeout_s: float | None = None) -> int:
        """How many leading keys have readable blocks (one batched RPC per node)."""
        readable = await self.contains(keys, timeout_s=timeout_s)
        return next((i for i, ok in enumerate(readable) if not ok), len(readable))

    async def delete(self, keys: Sequence[Key], *, timeout_s: float | None = None) -> None:
        """Delete this tenant's blocks under ``keys`` on every node of their groups.

        Raises Unavailable if, for some key, fewer than m+1 nodes confirmed: then up to k of
        its shards may survive and the block could still be readable; retry the delete.
        """
        await self.key_ops.delete(keys, timeout_s)

    async def node_stats(
        self, *, timeout_s: float | None = None
    ) -> dict[str, pb.StatsReply | None]:
        """Each node's Stats reply, or None for a node that did not answer."""
        return await self.key_ops.node_stats(timeout_s)

    async def wait_until_accepted(self, timeout_s: float = 30.0) -> None:
        """Return once every node accepts this client's token; Unavailable after ``timeout_s``.

        Nodes re-read the credentials file about once a second (later on a loaded machine),
        so a token just added (``kvstore cluster add-tenant``) is refused for a while; reads
        that return at k nodes hide that, a put that needs 11 does not."""
        await self.key_ops.wait_until_accepted(timeout_s)

    def replies_by_transport(self) -> dict[str, int]:
        """How many node read requests each transport answered: local, stream, ucx, grpc (the
        rest)."""
        stream_path = self.stream
        local = self.local.counters.num_local_replies if self.local else 0
        stream = stream_path.counters.num_local_replies if stream_path else 0
        ucx = self.ucx.counters.num_ucx_replies if self.ucx else 0
        grpc = self.read_counters.num_node_requests - local - stream - ucx
        return {"local": local, "stream": stream, "ucx": ucx, "grpc": max(grpc, 0)}

    def counters(self) -> dict[str, int]:
        """This client's read, write and follow-up counters (ReadCounters, WriteCounters and
        FollowUpCounters fields)."""
        return {
            **dataclasses.asdict(self.read_counters),
            **dataclasses.asdict(self.write_counters),
            **dataclasses.asdict(self.follow_ups.counters),
        }

    async def settle_puts(self) -> None:
        """Wait until the shard puts that returned puts left running in the background are
        done (each bounded by its put's deadline): stored, or failed and counted in
        ``write_counters.num_degraded_puts``."""
        await self.writes.settle()

    async def close(self) -> None:
        """Let background shard puts finish (bounded by their deadline), then close channels."""
        if self._closed:
            return
        self._closed = True
        if self._map_follower is not None:
            await self._map_follower.close()
        await self.settle_puts()
        await self.follow_ups.close()  # touches and hints still pending go out first
        await self.transports.close()
        self.reads.close()


async def _load_config(cluster_toml: str | Path | ClusterConfig) -> ClusterConfig:
    """The map a client starts from: the config given, or the file's (read off the loop)."""
    if isinstance(cluster_toml, ClusterConfig):
        return cluster_toml
    return await asyncio.to_thread(load_cluster, cluster_toml)


class _Connecting:
    """What :meth:`KVClient.connect` returns: awaitable, and an async context manager."""

    def __init__(self, open_client: Callable[[], Awaitable[KVClient]]) -> None:
        self._open_client = open_client
        self._client: KVClient | None = None

    def __await__(self) -> Generator[Any, None, KVClient]:
        return self._open_client().__await__()

    async def __aenter__(self) -> KVClient:
        self._client = await self._open_client()
        return self._client

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.close()
