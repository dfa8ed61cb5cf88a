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
single-key calls are batches of one.

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
import logging
import os
from collections.abc import Awaitable, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Literal, overload

from client.batch_read import BatchRead, OnLanded, ReadCounters, ReadTimes
from client.buffers import Buffer, byte_view, writable_view
from client.follow_ups import FollowUps
from client.integrity import XXH3_CHECK, BlockIntegrity, tenant_key
from client.keyring import open_keyring
from client.keys import as_key
from client.landing_pool import LandingPool
from client.local.reader import LocalReads
from client.map_follower import MapFollower
from client.node_conn import NodeConn, NodeReader, consume_result
from client.read_outcome import BatchResult, check_on_timeout, raise_timeouts
from client.read_timeline import ReadTimeline
from client.sealer import OVERHEAD_BYTES, BlockSealer
from client.shard_tally import PresenceTally
from client.transports import NodeTransports
from client.ucx.reader import UcxReads
from client.write_path import BatchWrite, WriteCounters, WritePolicy
from erasure.codec import make_codec
from kvstore.auth import client_token
from kvstore.byte_arena import ByteArena
from kvstore.config import READ_TRANSPORTS, ClusterConfig, load_cluster
from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unavailable,
)
from kvstore.placement import Placement
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tls import channel_credentials
from ttl.clock import Clock, make_clock

log = logging.getLogger(__name__)

Key = bytes | str  # 16 bytes, or a str hashed by client.keys.string_key
TRANSPORTS = READ_TRANSPORTS
WRITE_SPARE_BYTES = 64 << 20  # parity and padded tails of one put_batch are encoded here
DECODE_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Landing:
    """What :meth:`KVClient.land_batch` did, per key of the batch."""

    landed: list[bool]  # the block is in its buffer, verified
    rewritten: list[bool]  # bytes were written after on_landed announced them: copy again


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
        self.transports = NodeTransports(self.codec, tenant, token, credentials, landing_pool)
        self._place(config)
        self.read_counters = ReadCounters()
        self.read_times = ReadTimes()
        # Set a ReadTimeline here to record where batch reads spend their time (benchmarks).
        self.timeline: ReadTimeline | None = None
        self.write_counters = WriteCounters()
        # Touches after read hits, repair hints after short reads and writes (background).
        self.follow_ups = FollowUps(self.conns, config.groups, tenant, config.client.timeout_s)
        self._write_spare = ByteArena(WRITE_SPARE_BYTES)
        self._background: set[asyncio.Task[Any]] = set()
        # Batch decodes (a block checksum pass each, and any parity rebuild) run here.
        self._decode_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="kv-decode")
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
    def _conn_list(self) -> list[NodeConn]:
        return self.transports.conn_list

    @property
    def readers(self) -> list[NodeReader]:
        """The read transport of each node, in ``conns`` order: gRPC, UCX or local."""
        return self.transports.readers

    @property
    def ucx(self) -> UcxReads | None:
        """The UCX read path, when connect() enabled it."""
        return self.transports.ucx

    @property
    def local(self) -> LocalReads | None:
        """The local read path (same-host nodes), when connect() enabled it."""
        return self.transports.local

    def _place(self, config: ClusterConfig) -> None:
        """Channels to every node of ``config`` (kept for nodes already known) and its groups
        as node indexes: ``groups`` for writes and first reads, ``moving_from`` (during a map
        change) for the reads that miss."""
        self.transports.add_nodes(config)
        node_index = {node_id: i for i, node_id in enumerate(self.conns)}
        self._group_members = [[node_index[n] for n in group] for group in config.groups]
        self._previous_members = [[node_index[n] for n in g] for g in config.moving_from]

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
        for conn in self._conn_list:  # a node back in the map is dialed now, not after backoff
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
        address this client reaches); "auto" = UCX to each node a shared-memory/RDMA UCX
        worker reaches (learned in the background), gRPC to the rest. Results are identical.
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

    def _timeout_s(self, timeout_s: float | None) -> float:
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
        if len(keys) != len(blocks):
            raise InvalidArgument(
                f"put_batch got {len(keys)} keys but {len(blocks)} blocks; pass one block per key"
            )
        keys = [as_key(key) for key in keys]
        self.config.ttl.classes.check(traffic_class)
        own_ttl_s = _own_ttl_s(ttl_s)
        views = [self._block_view(block) for block in blocks]
        if self.sealer is not None:  # sealed before erasure coding (client/sealer.py)
            views = [memoryview(self.sealer.seal(k, v)) for k, v in zip(keys, views, strict=True)]
        if not keys:
            return
        groups = [self.placement.group_index(key) for key in keys]

        def on_short(positions: list[int]) -> None:
            for position in positions:
                self.follow_ups.hint_repair(groups[position], keys[position])

        write = BatchWrite(
            self.codec,
            self._conn_list,
            self._group_members,
            self._write_policy(),
            self._write_spare,
            self.write_counters,
            self._background,
            on_short,
            self.integrity,
        )
        await write.run(
            keys,
            groups,
            views,
            traffic_class,
            self._timeout_s(timeout_s),
            self.clock.now(),
            own_ttl_s,
        )

    def _write_policy(self) -> WritePolicy:
        client = self.config.client
        return WritePolicy(
            quorum=client.write_quorum,
            min_shards=self.config.min_write_shards,
            hedge_delay_s=client.hedge_delay_s,
            k=self.config.codec.k,
        )

    def _block_view(self, data: Buffer) -> memoryview:
        view = byte_view(data, "put data")
        max_bytes = self.config.codec.max_block_bytes - (OVERHEAD_BYTES if self.sealer else 0)
        if not 0 < len(view) <= max_bytes:
            raise InvalidArgument(
                f"a block must be 1 to {max_bytes} bytes (max_block_bytes in cluster.toml), "
                f"got {len(view)} bytes; split larger data into several blocks"
            )
        return view

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
        check_on_timeout(on_timeout)
        read, timed_out = await self._read(keys, [None] * len(keys), timeout_s)
        blocks = [b if b is None or isinstance(b, bytes) else bytes(b) for b in read]
        result = BatchResult.of(blocks, timed_out)
        if on_timeout == "raise":
            raise_timeouts(keys, result, self._timeout_s(timeout_s))
        return result if outcomes else result.blocks

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
        if len(keys) != len(buffers):
            raise InvalidArgument(
                f"get_batch_into got {len(keys)} keys but {len(buffers)} buffers; "
                "pass one buffer per key"
            )
        check_on_timeout(on_timeout)
        outs = [writable_view(buffer, f"buffer {i}") for i, buffer in enumerate(buffers)]
        rewritten: set[int] = set()
        blocks, timed_out = await self._read(keys, outs, timeout_s, on_landed, rewritten)
        if on_timeout == "raise":
            landed = [None if b is None else b"" for b in blocks]  # Timeout carries no buffers
            raise_timeouts(keys, BatchResult.of(landed, timed_out), self._timeout_s(timeout_s))
        return Landing(
            [block is not None for block in blocks],
            [i in rewritten for i in range(len(blocks))],
        )

    async def _read(
        self,
        keys: Sequence[Key],
        outs: Sequence[memoryview | None],
        timeout_s: float | None,
        on_landed: OnLanded | None = None,
        rewritten: set[int] | None = None,
    ) -> tuple[list[bytes | memoryview | None], list[bool]]:
        """The blocks, and per key whether the deadline passed before it was decided."""
        keys = [as_key(key) for key in keys]
        if not keys:
            return [], []
        read = self._batch_read(self._group_members)
        groups = [self.placement.group_index(key) for key in keys]
        if self.sealer is None:
            placed = await self._read_placed(read, keys, groups, outs, timeout_s, on_landed)
            if rewritten is not None:
                rewritten.update(read.rewritten)
            return placed
        # A sealed block decodes into its own buffer; opening it writes the caller's.
        sealed, timed_out = await self._read_placed(
            read, keys, groups, [None] * len(keys), timeout_s
        )
        opened = [
            None if block is None else self.sealer.open(key, block, out)
            for key, block, out in zip(keys, sealed, outs, strict=True)
        ]
        return opened, timed_out

    def _batch_read(self, group_members: Sequence[Sequence[int]]) -> BatchRead:
        return BatchRead(
            self.codec,
            self._conn_list,
            self.readers,
            group_members,
            self.config.client.read_fanout,
            min(n.max_batch_bytes for n in self.config.nodes),
            self.read_counters,
            self.config.client.hedge_delay_s,
            self.follow_ups,
            decode_pool=self._decode_pool,
            landing_pool=self.landing_pool,
            times=self.read_times,
            block_check=self.integrity or XXH3_CHECK,
            timeline=self.timeline,
        )

    async def _read_placed(
        self,
        read: BatchRead,
        keys: Sequence[bytes],
        groups: list[int],
        outs: Sequence[memoryview | None],
        timeout_s: float | None,
        on_landed: OnLanded | None = None,
    ) -> tuple[list[bytes | memoryview | None], list[bool]]:
        """The blocks from the current placement, and which keys timed out; during a map
        change, the keys it misses whose group changed are read again from the placement
        before the change, within what is left of the same deadline (their blocks then count
        as rewritten: no shard of the second read is announced)."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self._timeout_s(timeout_s)
        blocks = await read.run(keys, groups, outs, self._timeout_s(timeout_s), on_landed)
        timed_out = list(read.timed_out)
        previous = self.config.moving_from
        again = [
            i
            for i, block in enumerate(blocks)
            if block is None and previous and previous[groups[i]] != self.config.groups[groups[i]]
        ]
        if not again:
            return blocks, timed_out
        before = self._batch_read(self._previous_members)
        found = await before.run(
            [keys[i] for i in again],
            [groups[i] for i in again],
            [outs[i] for i in again],
            max(0.0, deadline_s - loop.time()),
        )
        for i, block, late in zip(again, found, before.timed_out, strict=True):
            blocks[i], timed_out[i] = block, block is None and (late or timed_out[i])
            read.rewritten.add(i)
        return blocks, timed_out

    async def contains(self, keys: Sequence[Key], *, timeout_s: float | None = None) -> list[bool]:
        """For each key: is its block readable (some version on >= k nodes)? TTLs not refreshed."""
        keys = [as_key(key) for key in keys]
        timeout_s = self._timeout_s(timeout_s)
        node_to_positions = self._positions_by_node(keys)
        num_asked = [0] * len(keys)  # k+m, or more during a map change (both placements)
        for positions in node_to_positions.values():
            for position in positions:
                num_asked[position] += 1
        tally = PresenceTally(num_asked, self.config.codec.k)

        async def ask(node_id: str, positions: list[int]) -> None:
            request = pb.ContainsRequest(tenant=self.tenant, keys=[keys[p] for p in positions])
            try:
                reply = await self.conns[node_id].call("Contains", request, timeout_s)
            except PermissionDenied:
                raise
            except KVStoreError:
                for position in positions:
                    tally.add_no_reply(position)
                return
            for position, result in zip(positions, reply.results, strict=True):
                tally.add_reply(position, result.versions)

        calls = [ask(node_id, positions) for node_id, positions in node_to_positions.items()]
        await _run_until(calls, lambda: tally.all_decided, timeout_s)
        return [bool(readable) for readable in tally.readable]

    async def match_prefix(self, keys: Sequence[Key], *, timeout_s: float | None = None) -> int:
        """How many leading keys have readable blocks (one batched RPC per node)."""
        readable = await self.contains(keys, timeout_s=timeout_s)
        return next((i for i, ok in enumerate(readable) if not ok), len(readable))

    async def delete(self, keys: Sequence[Key], *, timeout_s: float | None = None) -> None:
        """Delete this tenant's blocks under ``keys`` on every node of their groups.

        Raises Unavailable if, for some key, fewer than m+1 nodes confirmed: then up to k of
        its shards may survive and the block could still be readable; retry the delete.
        """
        keys = [as_key(key) for key in keys]
        node_to_positions = self._positions_by_node(keys)
        request_of = {
            node_id: pb.DeleteRequest(tenant=self.tenant, keys=[keys[p] for p in positions])
            for node_id, positions in node_to_positions.items()
        }
        timeout_s = self._timeout_s(timeout_s)
        replies = await asyncio.gather(
            *(self.conns[n].call("Delete", r, timeout_s) for n, r in request_of.items()),
            return_exceptions=True,
        )
        self._check_deleted(keys, node_to_positions, replies)

    def _check_deleted(
        self,
        keys: Sequence[bytes],
        node_to_positions: dict[str, list[int]],
        replies: list[Any],
    ) -> None:
        num_confirmed = [0] * len(keys)
        for positions, reply in zip(node_to_positions.values(), replies, strict=True):
            if isinstance(reply, PermissionDenied):
                raise reply
            if isinstance(reply, BaseException):
                continue
            for position in positions:
                num_confirmed[position] += 1
        needed = self.config.codec.m + 1
        if any(n < needed for n in num_confirmed):
            failed = [r for r in replies if isinstance(r, BaseException)]
            raise Unavailable(
                f"delete reached fewer than {needed} nodes for some keys, so their blocks may "
                f"still be readable ({failed[:3]}); retry the delete when the nodes are back"
            )

    def _positions_by_node(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Node id -> positions of the keys it holds a shard of (one batch per node); during
        a map change the old placement's nodes too, so a delete reaches every copy."""
        node_to_positions: dict[str, list[int]] = {}
        previous = self.config.moving_from
        for group_index, positions in self.placement.keys_by_group(keys).items():
            members = dict.fromkeys(self.config.groups[group_index])
            members.update(dict.fromkeys(previous[group_index] if previous else ()))
            for node_id in members:
                node_to_positions.setdefault(node_id, []).extend(positions)
        return node_to_positions

    async def node_stats(
        self, *, timeout_s: float | None = None
    ) -> dict[str, pb.StatsReply | None]:
        """Each node's Stats reply, or None for a node that did not answer."""
        timeout_s = self._timeout_s(timeout_s)
        replies = await asyncio.gather(
            *(conn.call("Stats", pb.StatsRequest(), timeout_s) for conn in self.conns.values()),
            return_exceptions=True,
        )
        return {
            node_id: None if isinstance(reply, BaseException) else reply
            for node_id, reply in zip(self.conns, replies, strict=True)
        }

    async def wait_until_accepted(self, timeout_s: float = 30.0) -> None:
        """Return once every node accepts this client's token; Unavailable after ``timeout_s``.

        Nodes re-read the credentials file about once a second (later on a loaded machine),
        so a token just added (``kvstore cluster add-tenant``) is refused for a while; reads
        that return at k nodes hide that, a put that needs 11 does not."""
        request = pb.ContainsRequest(tenant=self.tenant, keys=[bytes(16)])
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        while True:
            calls = (conn.call("Contains", request, 5.0) for conn in self.conns.values())
            replies = await asyncio.gather(*calls, return_exceptions=True)
            refused = [
                n
                for n, r in zip(self.conns, replies, strict=True)
                if isinstance(r, PermissionDenied)
            ]
            if not refused:
                return
            if loop.time() > deadline_s:
                raise Unavailable(
                    f"nodes {', '.join(refused)} still refuse this client's token after "
                    f"{timeout_s:g} s: is it in their credentials file?"
                )
            await asyncio.sleep(0.1)

    def replies_by_transport(self) -> dict[str, int]:
        """How many node read requests each transport answered: local, ucx, grpc (the rest)."""
        local = self.local.counters.num_local_replies if self.local else 0
        ucx = self.ucx.counters.num_ucx_replies if self.ucx else 0
        grpc = self.read_counters.num_node_requests - local - ucx
        return {"local": local, "ucx": ucx, "grpc": max(grpc, 0)}

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
        await asyncio.gather(*self._background, return_exceptions=True)

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
        self._decode_pool.shutdown(wait=False)


def _own_ttl_s(ttl_s: float | None) -> float:
    """A put's own TTL as the request carries it (0 = the class's); misuse raised."""
    if ttl_s is None:
        return 0.0
    if not isinstance(ttl_s, int | float) or not ttl_s > 0:
        raise InvalidArgument(f"ttl_s must be a number of seconds above 0 (or None), got {ttl_s!r}")
    return float(ttl_s)


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


async def _run_until(
    calls: Sequence[Awaitable[None]], is_done: Callable[[], bool], timeout_s: float
) -> None:
    """Run ``calls`` concurrently until ``is_done()`` or all finish or the timeout; cancel rest.

    Exceptions other than the ones the calls handle themselves propagate (the first one; the
    others of the same turn are retrieved, so asyncio never reports them as lost).
    """
    tasks = {asyncio.ensure_future(call) for call in calls}
    try:
        async with asyncio.timeout(timeout_s):
            while tasks and not is_done():
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
                if errors:
                    raise errors[0]
    except TimeoutError:
        log.debug("contains: deadline passed with %d nodes outstanding", len(tasks))
    finally:
        for task in tasks:
            task.cancel()
            task.add_done_callback(consume_result)
