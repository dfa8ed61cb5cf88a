"""``KVClient``: the asyncio client of a kvstore cluster.

::

    kv = await KVClient.connect("DIR/cluster.toml", tenant="acme", token=None)
    async with KVClient.connect(...) as kv: ...          # or: async with await ...connect(...)
    await kv.put(key, data, traffic_class="chat")        # QuorumError below k shards stored
    await kv.get(key) -> bytes | None                    # None is a miss
    await kv.get_into(key, out) -> bool                  # decodes straight into ``out``
    await kv.contains(keys) -> list[bool]
    await kv.match_prefix(keys) -> int
    await kv.delete(keys); await kv.close()
    await kv.get_batch_into(keys, buffers) -> list[bool]  # the data plane (below)
    await kv.get_batch(keys) -> list[bytes | None]
    await kv.put_batch(keys, blocks, traffic_class="chat")   # QuorumError names the keys

The batch calls are the data plane: one request per node per batch (client/batch_read.py,
client/write_path.py), shard payloads landing straight in the caller's buffers. The
single-key calls are batches of one.

What a caller sees: ``get`` returns the exact bytes some ``put`` of that key stored, or None
(a miss, fewer than k reachable shards of one version, or the deadline passed); never a mix of
two writers' bytes and never bytes that fail the block checksum. Misuse (a key that is not 16
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
from typing import Any

from client.batch_read import BatchRead, OnLanded, ReadCounters, ReadTimes
from client.follow_ups import FollowUps
from client.integrity import XXH3_CHECK, BlockIntegrity, tenant_key
from client.keyring import open_keyring
from client.landing_pool import LandingPool
from client.local.reader import LocalReads
from client.map_follower import MapFollower
from client.node_conn import NodeConn, NodeReader, consume_result
from client.sealer import OVERHEAD_BYTES, BlockSealer
from client.shard_tally import PresenceTally
from client.transports import NodeTransports
from client.ucx.reader import UcxReads
from client.write_path import BatchWrite, WriteCounters, WritePolicy
from erasure.codec import byte_view, make_codec
from kvstore.auth import client_token
from kvstore.byte_arena import ByteArena
from kvstore.config import READ_TRANSPORTS, ClusterConfig, load_cluster
from kvstore.errors import (
    InvalidArgument,
    InvalidCodecInput,
    KVStoreError,
    PermissionDenied,
    Unavailable,
)
from kvstore.placement import Placement, check_key
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tls import channel_credentials
from ttl.clock import Clock, make_clock

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
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

    def apply_map(self, config: ClusterConfig) -> None:
        """Switch to a newer cluster map epoch (etcd membership) without reconnecting."""
        if config.epoch <= self.config.epoch:
            return
        self._place(config)
        self.config = config
        self.placement = Placement(config)
        self.follow_ups.set_groups(config.groups)

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
        placement before it). Channels connect lazily; a node that is down only shows up as a
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
        follower = MapFollower(config)
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
        key: bytes,
        data: Buffer,
        traffic_class: str = "chat",
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Store ``data`` under ``key``; QuorumError if fewer than min_write_shards (k) land."""
        await self.put_batch([key], [data], traffic_class=traffic_class, timeout_s=timeout_s)

    async def put_batch(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        *,
        traffic_class: str,
        timeout_s: float | None = None,
    ) -> None:
        """Store ``blocks[i]`` under ``keys[i]``: one PutShards per node for the whole batch.

        Stores every block it can. Raises QuorumError naming the keys (also as its ``keys``
        attribute) whose blocks reached fewer than min_write_shards nodes; the other blocks
        are stored. Misuse (bad key, unknown class, oversized block) raises before anything
        is sent. A block stored with fewer than k+m shards is hinted to repair.
        """
        if len(keys) != len(blocks):
            raise InvalidArgument(
                f"put_batch got {len(keys)} keys but {len(blocks)} blocks; pass one block per key"
            )
        for key in keys:
            check_key(key)
        self.config.ttl.classes.check(traffic_class)
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
            keys, groups, views, traffic_class, self._timeout_s(timeout_s), self.clock.now()
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
        view = _byte_view(data, "put data")
        max_bytes = self.config.codec.max_block_bytes - (OVERHEAD_BYTES if self.sealer else 0)
        if not 0 < len(view) <= max_bytes:
            raise InvalidArgument(
                f"a block must be 1 to {max_bytes} bytes (max_block_bytes in cluster.toml), "
                f"got {len(view)} bytes; split larger data into several blocks"
            )
        return view

    async def get(self, key: bytes, *, timeout_s: float | None = None) -> bytes | None:
        """The block stored under ``key``, or None (miss, too few shards, deadline)."""
        (block,) = await self.get_batch([key], timeout_s=timeout_s)
        return block

    async def get_into(self, key: bytes, out: Buffer, *, timeout_s: float | None = None) -> bool:
        """Decode the block straight into ``out`` (writable, exactly the block's size).

        Returns False on a miss (``out`` may then hold partial data). Raises InvalidArgument
        when ``out`` is read-only or its size differs from the stored block's.
        """
        (landed,) = await self.get_batch_into([key], [out], timeout_s=timeout_s)
        return landed

    async def get_batch(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> list[bytes | None]:
        """Each key's block, or None (a miss): one request per node for the whole batch."""
        blocks = await self._read(keys, [None] * len(keys), timeout_s)
        return [b if b is None or isinstance(b, bytes) else bytes(b) for b in blocks]

    async def get_batch_into(
        self, keys: Sequence[bytes], buffers: Sequence[Buffer], *, timeout_s: float | None = None
    ) -> list[bool]:
        """Land each key's block in its buffer: True = it landed and was verified, False = a
        miss (that buffer may then hold partial data).

        Each buffer must be writable and exactly its block's size (InvalidArgument
        otherwise). Shard payloads land straight at their place in the buffers; a buffer
        from a long-lived pool (client/buffer_pool.py) is registered with UCX once, and one
        in the client's landing pool is written by the local nodes themselves.
        """
        return (await self.land_batch(keys, buffers, timeout_s=timeout_s)).landed

    async def land_batch(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        on_landed: OnLanded | None = None,
        timeout_s: float | None = None,
    ) -> Landing:
        """:meth:`get_batch_into` for engines that use blocks while they arrive.

        ``on_landed(pairs)`` is called on the event loop as node answers come in, with the
        (batch position, data shard index) of every data shard that is now at its place in
        its buffer (bytes ``[i*P, (i+1)*P)``, P = ceil(block bytes / k)); an engine may copy
        those bytes onward at once (client/readiness.py turns shards into layers). They are
        not verified yet: the returned :class:`Landing` says which blocks were (``landed``)
        and which had bytes written again after they were announced (``rewritten``: a shard
        recovered from parity or replaced after a failed check); copy those again.
        """
        if len(keys) != len(buffers):
            raise InvalidArgument(
                f"get_batch_into got {len(keys)} keys but {len(buffers)} buffers; "
                "pass one buffer per key"
            )
        outs = [_writable(buffer, i) for i, buffer in enumerate(buffers)]
        rewritten: set[int] = set()
        blocks = await self._read(keys, outs, timeout_s, on_landed, rewritten)
        return Landing(
            [block is not None for block in blocks],
            [i in rewritten for i in range(len(blocks))],
        )

    async def _read(
        self,
        keys: Sequence[bytes],
        outs: Sequence[memoryview | None],
        timeout_s: float | None,
        on_landed: OnLanded | None = None,
        rewritten: set[int] | None = None,
    ) -> list[bytes | memoryview | None]:
        for key in keys:
            check_key(key)
        if not keys:
            return []
        read = self._batch_read(self._group_members)
        groups = [self.placement.group_index(key) for key in keys]
        if self.sealer is None:
            blocks = await self._read_placed(read, keys, groups, outs, timeout_s, on_landed)
            if rewritten is not None:
                rewritten.update(read.rewritten)
            return blocks
        # A sealed block decodes into its own buffer; opening it writes the caller's.
        sealed = await self._read_placed(read, keys, groups, [None] * len(keys), timeout_s)
        return [
            None if block is None else self.sealer.open(key, block, out)
            for key, block, out in zip(keys, sealed, outs, strict=True)
        ]

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
        )

    async def _read_placed(
        self,
        read: BatchRead,
        keys: Sequence[bytes],
        groups: list[int],
        outs: Sequence[memoryview | None],
        timeout_s: float | None,
        on_landed: OnLanded | None = None,
    ) -> list[bytes | memoryview | None]:
        """The blocks from the current placement; during a map change, the keys it misses
        whose group changed are read again from the placement before the change (their
        blocks then count as rewritten: no shard of the second read is announced)."""
        blocks = await read.run(keys, groups, outs, self._timeout_s(timeout_s), on_landed)
        previous = self.config.moving_from
        again = [
            i
            for i, block in enumerate(blocks)
            if block is None and previous and previous[groups[i]] != self.config.groups[groups[i]]
        ]
        if not again:
            return blocks
        found = await self._batch_read(self._previous_members).run(
            [keys[i] for i in again],
            [groups[i] for i in again],
            [outs[i] for i in again],
            self._timeout_s(timeout_s),
        )
        for i, block in zip(again, found, strict=True):
            blocks[i] = block
            read.rewritten.add(i)
        return blocks

    async def contains(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> list[bool]:
        """For each key: is its block readable (some version on >= k nodes)? TTLs not refreshed."""
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

    async def match_prefix(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading keys have readable blocks (one batched RPC per node)."""
        readable = await self.contains(keys, timeout_s=timeout_s)
        return next((i for i, ok in enumerate(readable) if not ok), len(readable))

    async def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> None:
        """Delete this tenant's blocks under ``keys`` on every node of their groups.

        Raises Unavailable if, for some key, fewer than m+1 nodes confirmed: then up to k of
        its shards may survive and the block could still be readable; retry the delete.
        """
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

    async def close(self) -> None:
        """Let background shard puts finish (bounded by their deadline), then close channels."""
        if self._closed:
            return
        self._closed = True
        if self._map_follower is not None:
            await self._map_follower.close()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.follow_ups.close()  # touches and hints still pending go out first
        await self.transports.close()
        self._decode_pool.shutdown(wait=False)


def _byte_view(buffer: object, what: str) -> memoryview:
    """The codec's flat view of a caller's buffer; misuse raised as the client's own
    InvalidArgument (the codec, a lower layer, has its own error for it)."""
    try:
        return byte_view(buffer, what)
    except InvalidCodecInput as exc:
        raise InvalidArgument(str(exc)) from None


def _writable(buffer: Buffer, position: int) -> memoryview:
    view = _byte_view(buffer, f"buffer {position}")
    if view.readonly:
        raise InvalidArgument(
            f"buffer {position} is read-only {type(buffer).__name__}; get_batch_into needs "
            "writable buffers (bytearray, numpy array, a BufferPool slot)"
        )
    return view


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
