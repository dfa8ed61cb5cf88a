"""One storage node: the grpc.aio server over a :class:`~kvstore.store.shard_store.ShardStore`.

``kvstore node --config DIR/cluster.toml --id ID [--inject-delay-ms MS]`` runs it in the
foreground: it binds ``NodeConfig.address`` (refusing a port another process holds: no
SO_REUSEPORT, and the bind's result is checked) and answers Health with ``serving = false``
while it recovers the store (rebuilding a lost or damaged index from the segments,
kvstore/store/index_rebuild.py, or migrating an old one). Then it runs one expiry pass, serves every
RPC, Prometheus on ``metrics_port`` (0 = off), prints ``node <id> serving on <address>``, and
on SIGTERM or SIGINT finishes in-flight requests, persists pending TTL refreshes and closes the
index. In the background it runs upkeep ticks, the scrub (kvstore/store/scrub.py), the pull of
its peers' delete logs (kvstore/node/tombstones.py) and the repair service
(kvstore/node/repair_service.py).
An index that fails while serving (lmdb pages that no longer read) takes the node back to
``serving = false`` while it rebuilds; data RPCs get UNAVAILABLE meanwhile, which clients treat
like a node that is down.

The servicer is a thin shell: it finds the caller's principal from its credential (a bearer
token or a verified mTLS client certificate, kvstore/auth.py; every RPC but Health, which
tells only the node's id, epoch and clock, so health checkers need no secret), derives the
tenant from it (a request naming another tenant is PERMISSION_DENIED before the store is
touched), injects the straggler delay, runs the store call in the node's one thread pool
(reads overlap, writes serialize inside the store) and maps kvstore errors to gRPC status
codes through :func:`kvstore.grpc_errors.to_grpc_status` only. A node principal (a peer's
repair service) may read any tenant's shards and write repair puts, as it holds those tenants'
shards on its own disk anyway; it may not write ordinary puts, delete or purge. A node takes
repair puts only once it has pulled its peers' delete logs since it started, so a repair
cannot bring back a block deleted while this node was away. In the background the node also
applies the tenants' retention caps.

One exception to "blocking work runs in the pool": a get of at most ``INLINE_GET_MAX_KEYS``
keys runs on the event loop. It is an lmdb read snapshot and a ``pread`` per shard (tens of
microseconds from the page cache), while the hop to the pool and back (a thread wake-up and the
loop's self-pipe) cost more CPU than the read itself and doubled a small get's latency. Larger
batches still go to the pool, so one request never holds the loop for long. Get replies are
encoded by :func:`kvstore.node.get_reply.encode_get_shards_reply` with one copy of each shard
instead of protobuf's two.

Message sizes: gRPC's send and receive limits are ``max_batch_bytes`` plus 1 MiB of slack for
framing. A put whose shards add up to more than ``max_batch_bytes`` but fit the slack gets
INVALID_ARGUMENT from the store; a larger message is refused by gRPC itself with
RESOURCE_EXHAUSTED before it reaches the node. A get or batch read whose reply would pass
``max_batch_bytes`` gets INVALID_ARGUMENT (ask for fewer keys per request), decided from the
index before any byte is read; a key named twice in one request is read once.

Batch reads. ``ReadBatch`` (gRPC) and the UCX request (kvstore/wire/ucx_frames.py) serve the
client's data plane: one request per node per batch. The store reads the whole batch in the
executor (one index snapshot, one ``preadv`` per shard into a staging region of
``ByteArena``), and the answer (kvstore/wire/batch_answer.py) goes back as a stream of chunks of at
most 4 MiB (gRPC) or as one reply frame plus one message per payload that the client
receives straight into its buffers (UCX). Unary ``GetShards`` stays for tools that want
protobuf replies, and for the repair service's reads of single shards. A client on the node's
host reads over the local channel instead (kvstore/node/local_server.py): a Unix socket whose
connection threads read straight into the client's own shared arena, with no gRPC and no event loop
on the path; Health tells its socket and the host's boot id.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1.health import aio as health_aio
from grpc_health.v1.health_pb2 import HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server

from kvstore.auth import Authenticator, Principal, Role, bearer_token
from kvstore.byte_arena import ByteArena, Region
from kvstore.config import ClusterConfig, NodeConfig, load_cluster
from kvstore.errors import IndexUnusable, InvalidArgument, KVStoreError, NotServing, Unavailable
from kvstore.grpc_errors import status_code, to_grpc_status
from kvstore.membership import EtcdMembership, follow_map
from kvstore.node import ucx_server
from kvstore.node.get_reply import encode_get_shards_reply
from kvstore.node.local_server import LocalServer, LocalSession, RegionTooSmall
from kvstore.node.map_keeper import keep_map
from kvstore.node.metrics import NodeMetrics
from kvstore.node.repair_service import RepairService, RepairStats
from kvstore.node.scrubber import scrub_forever
from kvstore.node.tombstones import MAX_TOMBSTONES_PER_REPLY, TombstoneSync, sync_forever
from kvstore.node.ucx_server import UcxServer
from kvstore.placement import Placement
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.recovery import move_index_aside
from kvstore.store.request_checks import check_tenant
from kvstore.store.scrub import ScrubStep
from kvstore.store.shard_store import (
    BatchRead,
    GetResult,
    PutOptions,
    ShardStore,
    StoreStats,
    empty_stats,
)
from kvstore.tls import peer_identity, server_credentials
from kvstore.wire import batch_answer, local_frames, ucx_frames
from kvstore.wire.ucx_worker import REQUEST_TAG, ucx_available
from ttl.clock import Clock, make_clock

log = logging.getLogger(__name__)

MESSAGE_SLACK_BYTES = 1 << 20
# Gets of at most this many keys run on the event loop (see the module docstring): with
# 410 KiB shards that is under 2 MB of page-cache reads, a few hundred microseconds at most.
INLINE_GET_MAX_KEYS = 4
NUM_WORKER_THREADS = 8
STOP_GRACE_S = 5.0
HEALTH_POLL_S = 0.5  # grpc.health.v1 follows the store's state this often
SERVICE_NAME = "kvstore.v1.ShardStore"
MAX_LIST_PAGE = 4096


def upkeep_period_s(time_scale: float, expiry_window_s: float) -> float:
    """Real seconds between upkeep ticks: a quarter window, at least once a second, >= 50 ms."""
    return min(1.0, max(0.05, expiry_window_s / 4 / time_scale))


class PlacedMap:
    """The cluster map a node currently follows (swapped when etcd has a newer epoch): which
    group a key is filed under, and which shard of it this node holds."""

    def __init__(self, cluster: ClusterConfig, node_id: str) -> None:
        self.node_id = node_id
        self.set(cluster)

    def set(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.placement = Placement(cluster)
        self.group_to_position = {
            g: m.index(self.node_id) for g, m in enumerate(cluster.groups) if self.node_id in m
        }

    def group_of(self, key: bytes) -> int:
        return self.placement.group_index(key)

    def shard_index_of(self, key: bytes) -> int | None:
        return self.group_to_position.get(self.placement.group_index(key))


def open_store(
    cluster: ClusterConfig, node: NodeConfig, clock: Clock, placed: PlacedMap | None = None
) -> ShardStore:
    """The node's store, placed in the cluster: entries filed by placement group, and puts
    whose shards do not fit the cluster's code or this node's place (in the map ``placed``
    follows, if given) refused."""
    placed = placed or PlacedMap(cluster, node.id)
    return ShardStore(
        node,
        cluster.ttl,
        clock,
        group_of=placed.group_of,
        shard_index_of=placed.shard_index_of,
        codec=cluster.codec,
    )


class StoreHolder:
    """The node's store, absent while it is opened or rebuilt (Health says which)."""

    def __init__(self, open_: Callable[[], ShardStore], node: NodeConfig, executor: Executor):
        self._open = open_
        self._node = node
        self._executor = executor
        self.store: ShardStore | None = None
        self.state = "recovering"
        self._rebuild: asyncio.Task[None] | None = None

    def require(self) -> ShardStore:
        """The store, or NotServing (UNAVAILABLE) while there is none."""
        if self.store is None:
            raise NotServing(f"node {self._node.id} is not serving yet: {self.state}")
        return self.store

    def stats(self) -> StoreStats:
        return self.store.stats() if self.store is not None else empty_stats()

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        store = await loop.run_in_executor(self._executor, self._open)
        await loop.run_in_executor(self._executor, store.tick)  # expiry continues
        self.store, self.state = store, "serving"

    def rebuild_after(self, exc: IndexUnusable) -> None:
        """Stop serving and rebuild the index from the segments (once, however many RPCs
        saw the failure)."""
        if self._rebuild is None or self._rebuild.done():
            log.error("node %s: %s; rebuilding its index", self._node.id, exc)
            store, self.store, self.state = self.store, None, "rebuilding index"
            self._rebuild = asyncio.ensure_future(self._rebuild_index(store, str(exc)))

    async def _rebuild_index(self, store: ShardStore | None, why: str) -> None:
        loop = asyncio.get_running_loop()
        if store is not None:
            await loop.run_in_executor(self._executor, _close_quietly, store)
        index_dir = Path(self._node.data_dir) / "index"
        await loop.run_in_executor(self._executor, move_index_aside, index_dir, why)
        await self.open()

    async def close(self) -> None:
        if self._rebuild is not None:
            await asyncio.gather(self._rebuild, return_exceptions=True)
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.store.close)
            self.store = None


def _close_quietly(store: ShardStore) -> None:
    try:
        store.close()
    except Exception:
        log.exception("closing the store with the damaged index failed")


Handler = Callable[[Any, Principal], Message | bytes]


class NodeServicer:
    """The gRPC face of one node's store.

    Requests arrive as raw bytes and are parsed here, so a malformed message gets
    INVALID_ARGUMENT (gRPC's own deserializer would answer UNKNOWN). Every handler gets the
    caller's principal and checks it first.
    """

    def __init__(
        self,
        holder: StoreHolder,
        node: NodeConfig,
        epoch: int,
        metrics: NodeMetrics,
        executor: ThreadPoolExecutor,
        ucx: UcxServer | None = None,
        auth: Authenticator | None = None,
        repair: RepairService | None = None,
        deletes_synced: Callable[[], bool] = lambda: True,
    ) -> None:
        self._holder = holder
        self._repair = repair
        self._deletes_synced = deletes_synced
        self._incarnation = time.time_ns()
        self._auth = auth or Authenticator(None)
        self._ucx = ucx
        self._node = node
        self._epoch = epoch
        self._metrics = metrics
        self._executor = executor
        self._delay_s = node.inject_delay_ms / 1000.0
        self.local_socket = ""  # the local read server's socket, once serve() started it
        self._boot_id = local_frames.boot_id()
        self._ucx_tasks: set[asyncio.Task[None]] = set()
        # Batch reads gather their payloads here (kvstore/byte_arena.py): twice the largest
        # answer, so two answers of that size can be in flight without a fallback buffer.
        self._staging = ByteArena(2 * node.max_batch_bytes)
        if ucx is not None:
            ucx.worker.listen(REQUEST_TAG, self._on_ucx_request, ucx_frames.MAX_REQUEST_BYTES)
        self._unary = {
            "PutShards": (pb.PutShardsRequest, self._put, True),
            "GetShards": (pb.GetShardsRequest, self._get, True),
            "Contains": (pb.ContainsRequest, self._contains, True),
            "Delete": (pb.DeleteRequest, self._delete, True),
            "Purge": (pb.PurgeRequest, self._purge, False),
            "ListTombstones": (pb.ListTombstonesRequest, self._list_tombstones, False),
            "Stats": (pb.StatsRequest, self._stats, False),
            "Health": (pb.HealthRequest, self._health, False),
            "TouchShards": (pb.TouchShardsRequest, self._touch, True),
            "ListShards": (pb.ListShardsRequest, self._list, False),
            "QueueRepair": (pb.QueueRepairRequest, self._queue_repair, False),
        }

    def set_epoch(self, epoch: int) -> None:
        """The map epoch Health reports (a node follows etcd's map without a restart)."""
        self._epoch = epoch

    def register(self, server: grpc.aio.Server) -> None:
        """Add every RPC of ``kvstore.v1.ShardStore`` to ``server``."""
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._unary_method(name), response_serializer=_serialize
            )
            for name in self._unary
        }
        handlers["ReadBatch"] = grpc.unary_stream_rpc_method_handler(self._read_batch_stream)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )

    def _unary_method(self, rpc: str) -> Callable[[bytes, Any], Awaitable[Any]]:
        request_type, handler, delay = self._unary[rpc]

        async def method(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await self._serve(rpc, context, request_type, handler, raw, delay=delay)

        return method

    async def _read_batch_stream(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """ReadBatch: the batch answer as ReadBatchChunk messages (kvstore/wire/batch_answer.py)."""
        chunks = await self._serve(
            "ReadBatch", context, pb.GetShardsRequest, self._read_batch_chunks, raw, delay=True
        )
        for chunk in chunks:
            yield chunk

    async def _serve(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext,
        request_type: type[Message],
        handler: Handler,
        raw: bytes,
        *,
        delay: bool,
    ) -> Message | bytes:
        """Authenticate, delay (straggler), parse and run ``handler`` in the pool, map errors."""
        start_s = time.perf_counter()
        code, details, reply = grpc.StatusCode.OK, "", None
        try:
            principal = self._principal(context) if rpc != "Health" else None
            if delay and self._delay_s:
                await asyncio.sleep(self._delay_s)
            reply = await self._run(request_type, handler, raw, principal)
        except Exception as exc:
            if isinstance(exc, IndexUnusable):
                self._holder.rebuild_after(exc)
            code, details = to_grpc_status(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", rpc)
        self._metrics.observe(rpc, code, time.perf_counter() - start_s)
        if reply is None:
            await context.abort(code, details)
        return reply

    async def _run(
        self,
        request_type: type[Message],
        handler: Handler,
        raw: bytes,
        principal: Principal | None,
    ) -> Any:
        """Parse and handle ``raw``: small gets on the event loop, the rest in the pool."""
        loop = asyncio.get_running_loop()
        if handler not in (self._get, self._read_batch_chunks):
            return await loop.run_in_executor(
                self._executor, _parse_and_call, request_type, handler, raw, principal
            )
        request = _parse(request_type, raw)  # a get request holds keys only: cheap to parse
        if len(request.keys) <= INLINE_GET_MAX_KEYS:
            return handler(request, principal)
        return await loop.run_in_executor(self._executor, handler, request, principal)

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """Who the call comes from: its mTLS certificate's name or its bearer token."""
        if not self._auth.enabled:
            return self._auth.authenticate(None)
        metadata = dict(context.invocation_metadata() or ())
        return self._auth.authenticate(bearer_token(metadata), peer_identity(context))

    def _put(self, request: pb.PutShardsRequest, principal: Principal) -> pb.PutShardsReply:
        if request.repair:
            tenant = principal.tenant_for_repair(request.tenant)
            self._require_deletes_synced("takes repair writes")
        else:
            tenant = principal.tenant_for(request.tenant)
        items = [(s.key, s.shard) for s in request.shards]
        options = PutOptions(
            written_at_s=[s.written_at_s for s in request.shards],
            expires_at_s=request.expires_at_s,
            repair=request.repair,
        )
        result = self._holder.require().put(tenant, request.traffic_class, items, options)
        self._metrics.put_shards.inc(result.num_stored)
        return pb.PutShardsReply(
            num_stored=result.num_stored,
            num_superseded=result.num_superseded,
            num_fenced=result.num_fenced,
        )

    def _require_deletes_synced(self, what: str) -> None:
        """Unavailable until the node has pulled its peers' delete logs (a repair must not
        copy, or be handed, a block deleted while this node was away)."""
        if not self._deletes_synced():
            raise Unavailable(
                f"node {self._node.id} {what} once it has pulled its peers' delete logs; "
                "retry shortly"
            )

    def _get(self, request: pb.GetShardsRequest, principal: Principal) -> bytes:
        """The serialized GetShardsReply (encoded here: one copy of each shard)."""
        tenant = principal.tenant_for_repair(request.tenant)
        return encode_get_shards_reply(self._lookup(request, tenant))

    def _read_batch(self, request: pb.GetShardsRequest, tenant: str) -> BatchRead:
        """The batch answer, payloads in a staging region (release it once sent)."""
        return self._read_keys(tenant, list(request.keys), request.version, self._staging.take)

    def _read_keys(
        self,
        tenant: str,
        keys: list[bytes],
        version: bytes,
        take: Callable[[int], Region],
        *,
        shared: bool = False,
    ) -> BatchRead:
        """A batch read of ``keys`` for ``tenant`` (already authorised), the reply size
        checked against ``max_batch_bytes`` before any byte is read."""
        self._metrics.get_keys.inc(len(keys))
        return self._holder.require().read_batch(
            tenant, keys, version, take, max_reply_bytes=self._node.max_batch_bytes, shared=shared
        )

    def open_local_session(self, token: str, tenant: str) -> LocalSession:
        """A local connection's HELLO: its principal must be allowed the tenant it names."""
        return LocalSession(token, self._auth.authenticate(token or None).tenant_for(tenant))

    def serve_local_read(
        self, session: LocalSession, request: local_frames.ReadRequest, region: memoryview
    ) -> bytes:
        """One local READ (in a connection thread, kvstore/node/local_server.py): the payloads go
        to ``region`` of the client's arena, the table is returned.

        The credential is checked again on every request (a revoked token stops at once),
        and the tenant is the one the connection was opened for: its arena never holds
        another tenant's bytes.
        """
        start_s = time.perf_counter()
        code = grpc.StatusCode.OK
        staging = Region(None, 0, region)

        def take(num_bytes: int) -> Region:
            if num_bytes > len(region):
                raise RegionTooSmall(num_bytes)
            return staging

        try:
            tenant = self._auth.authenticate(session.token or None).tenant_for(session.tenant)
            read = self._read_keys(tenant, request.keys, request.version, take, shared=True)
            if read.staging is not staging:  # a retry outgrew the first guess: copy it over
                if read.payload_bytes > len(region):
                    raise RegionTooSmall(read.payload_bytes)
                region[: read.payload_bytes] = read.payloads
            return batch_answer.encode_table(read.entries)
        except RegionTooSmall:
            raise
        except Exception as exc:
            code = status_code(exc)
            raise
        finally:
            self._metrics.observe("ReadBatchLocal", code, time.perf_counter() - start_s)

    def _read_batch_chunks(self, request: pb.GetShardsRequest, principal: Principal) -> list[bytes]:
        """ReadBatch's answer as ReadBatchChunk messages (one copy of the staging)."""
        read = self._read_batch(request, principal.tenant_for_repair(request.tenant))
        try:
            return batch_answer.encode_chunks(
                batch_answer.encode_table(read.entries), read.payloads
            )
        finally:
            read.release()

    def _on_ucx_request(self, frame: memoryview) -> None:
        """A batch read that came over UCX (kvstore/wire/ucx_frames.py): answered over UCX.

        Called by the UCX worker's progress loop. As over gRPC, a read of a few keys is done
        right here; the straggler delay and larger batches (read in the pool) run in a task.
        """
        start_s = time.perf_counter()
        try:
            token, request = ucx_frames.decode_request(frame)
        except InvalidArgument as exc:  # no reply address to refuse it to
            log.warning("dropping a malformed UCX read request: %s", exc)
            self._metrics.observe("ReadBatchUcx", status_code(exc), time.perf_counter() - start_s)
            return
        if self._delay_s or len(request.keys) > INLINE_GET_MAX_KEYS:
            task = asyncio.ensure_future(self._serve_ucx_request(token, request, start_s))
            self._ucx_tasks.add(task)
            task.add_done_callback(self._ucx_tasks.discard)
        else:
            self._answer_ucx_request(token, request, None, start_s)

    async def cancel_ucx_requests(self) -> None:
        """Stop the UCX reads still being answered (their clients fall back to gRPC)."""
        for task in self._ucx_tasks:
            task.cancel()
        await asyncio.gather(*self._ucx_tasks, return_exceptions=True)

    async def _serve_ucx_request(
        self, token: str, request: pb.GetShardsRequest, start_s: float
    ) -> None:
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        read: BatchRead | Exception
        try:
            tenant = self._ucx_tenant(token, request)
            loop = asyncio.get_running_loop()
            read = await loop.run_in_executor(self._executor, self._read_batch, request, tenant)
        except Exception as exc:  # answered below, like a failure of an inline read
            read = exc
        self._answer_ucx_request(token, request, read, start_s)

    def _ucx_tenant(self, token: str, request: pb.GetShardsRequest) -> str:
        """The tenant a UCX read acts for (UCX has no TLS: the token is the only credential)."""
        return self._auth.authenticate(token or None).tenant_for(request.tenant)

    def _answer_ucx_request(
        self,
        token: str,
        request: pb.GetShardsRequest,
        read: BatchRead | Exception | None,
        start_s: float,
    ) -> None:
        """Authenticate and read (unless ``read`` holds the read's outcome), then answer over
        UCX; the staging is released once the client took the payloads."""
        assert self._ucx is not None
        code = grpc.StatusCode.OK
        try:
            if isinstance(read, Exception):
                raise read
            if read is None:
                read = self._read_batch(request, self._ucx_tenant(token, request))
            try:
                sent = ucx_server.answer(self._ucx, request.ucx, read)
            except BaseException:
                read.release()
                raise
            sent.add_done_callback(lambda _, done=read: done.release())
        except Exception as exc:  # the client hears of every failure at once, as over gRPC
            error = exc if isinstance(exc, KVStoreError) else None
            if error is None:
                log.exception("UCX read request failed")
                error = KVStoreError(f"{type(exc).__name__}: {exc}")  # INTERNAL
            code = status_code(error)
            ucx_server.refuse(self._ucx, request.ucx, error)
        self._metrics.observe("ReadBatchUcx", code, time.perf_counter() - start_s)

    def _lookup(self, request: pb.GetShardsRequest, tenant: str) -> list[GetResult]:
        self._metrics.get_keys.inc(len(request.keys))
        return self._holder.require().get(
            tenant,
            list(request.keys),
            request.version,
            max_reply_bytes=self._node.max_batch_bytes,
        )

    def _contains(self, request: pb.ContainsRequest, principal: Principal) -> pb.ContainsReply:
        store = self._holder.require()
        found = store.contains(principal.tenant_for(request.tenant), list(request.keys))
        return pb.ContainsReply(results=[pb.KeyVersions(versions=v) for v in found])

    def _delete(self, request: pb.DeleteRequest, principal: Principal) -> pb.DeleteReply:
        tenant = principal.tenant_for(request.tenant)
        num_deleted = self._holder.require().delete(tenant, list(request.keys))
        return pb.DeleteReply(num_deleted=num_deleted)

    def _touch(self, request: pb.TouchShardsRequest, principal: Principal) -> pb.TouchShardsReply:
        principal.require(Role.TENANT, Role.SERVICE)  # a client's follow-up to its read
        tenant = principal.tenant_for(request.tenant)
        store = self._holder.require()
        num = store.touch(tenant, list(request.keys), list(request.versions))
        return pb.TouchShardsReply(num_touched=num)

    def _list(self, request: pb.ListShardsRequest, principal: Principal) -> pb.ListShardsReply:
        principal.require(Role.NODE, Role.ADMIN)
        self._require_deletes_synced("lists its shards for repair")
        limit = max(1, min(request.limit or MAX_LIST_PAGE, MAX_LIST_PAGE))
        entries, next_after = self._holder.require().list_group(
            request.group, request.start_after, limit
        )
        shards = [
            pb.ListedShard(
                tenant=e.tenant,
                key=e.key,
                version=e.version,
                shard_index=e.shard_index,
                written_at_s=e.created_s,
                expires_at_s=e.expires_at_s,
                traffic_class=e.traffic_class,
                shard_bytes=e.shard_bytes,
            )
            for e in entries
        ]
        return pb.ListShardsReply(shards=shards, next_after=next_after)

    def _queue_repair(
        self, request: pb.QueueRepairRequest, principal: Principal
    ) -> pb.QueueRepairReply:
        """Hints from clients (read-repair, degraded writes) or peers: each for a tenant the
        caller may act for."""
        principal.require(Role.TENANT, Role.SERVICE, Role.NODE)
        if self._repair is None:
            raise Unavailable(f"node {self._node.id} runs no repair service")
        hints = [(principal.tenant_for_repair(h.tenant), h.key, h.group) for h in request.hints]
        for tenant, _, _ in hints:
            check_tenant(tenant)
        return pb.QueueRepairReply(num_queued=self._repair.queue(hints))

    def _purge(self, request: pb.PurgeRequest, principal: Principal) -> pb.PurgeReply:
        principal.require(Role.ADMIN)
        erased = self._holder.require().purge(request.tenant)
        log.info(
            "purged tenant %r: %d shards, %d bytes",
            request.tenant,
            erased.num_shards,
            erased.num_bytes,
        )
        return pb.PurgeReply(
            node_id=self._node.id, num_deleted=erased.num_shards, bytes_erased=erased.num_bytes
        )

    def _list_tombstones(
        self, request: pb.ListTombstonesRequest, principal: Principal
    ) -> pb.ListTombstonesReply:
        principal.require(Role.NODE, Role.ADMIN)
        limit = min(request.limit or MAX_TOMBSTONES_PER_REPLY, MAX_TOMBSTONES_PER_REPLY)
        records, last_seq = self._holder.require().tombstones(request.after_seq, limit)
        return pb.ListTombstonesReply(
            tombstones=[
                pb.Tombstone(seq=t.seq, tenant=t.tenant, key=t.key, at_s=t.at_s) for t in records
            ],
            last_seq=last_seq,
        )

    def _stats(self, request: pb.StatsRequest, principal: Principal) -> pb.StatsReply:
        principal.require(Role.ADMIN, Role.NODE)
        repair = self._repair.stats if self._repair is not None else RepairStats()
        reply = stats_reply(self._node.id, self._epoch, self._holder.stats(), repair)
        reply.pid = os.getpid()
        reply.filesystem_id, reply.filesystem_bytes = filesystem_of(self._node.data_dir)
        store = self._holder.store
        if store is None:
            return reply
        for tenant, caps in sorted(store.retention.tenant_to_max_ttl_s.items()):
            for traffic_class, cap_s in sorted(caps.items()):
                reply.retention_caps.add(
                    tenant=tenant, traffic_class=traffic_class, max_ttl_s=cap_s
                )
        _, reply.last_tombstone_seq = store.tombstones(0, 0)
        return reply

    def _health(self, request: pb.HealthRequest, principal: Principal | None) -> pb.HealthReply:
        store = self._holder.store
        return pb.HealthReply(
            node_id=self._node.id,
            epoch=self._epoch,
            serving=store is not None,
            now_s=store.clock.now() if store is not None else 0.0,
            ucx_worker_address=self._ucx.address if self._ucx is not None else b"",
            state=self._holder.state,
            incarnation=self._incarnation,
            repair_ready=store is not None and self._deletes_synced(),
            local_socket=self.local_socket,
            boot_id=self._boot_id if self.local_socket else "",
        )


def _serialize(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _parse(request_type: type[Message], raw: bytes) -> Message:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgument(
            f"malformed {request_type.DESCRIPTOR.full_name} message: {exc}; "
            "build requests from kvstore/proto/kvstore.proto"
        ) from None


def _parse_and_call(
    request_type: type[Message], handler: Handler, raw: bytes, principal: Principal | None
) -> Message | bytes:
    return handler(_parse(request_type, raw), principal)


def filesystem_of(path: str) -> tuple[str, int]:
    """("host:device", size in bytes) of the filesystem holding ``path`` (("", 0) if gone)."""
    try:
        device, fs = os.stat(path).st_dev, os.statvfs(path)
    except OSError:
        return "", 0
    return f"{socket.gethostname()}:{device}", fs.f_blocks * fs.f_frsize


def stats_reply(
    node_id: str, epoch: int, stats: StoreStats, repair: RepairStats | None = None
) -> pb.StatsReply:
    """The wire form of a store's (and its repair service's) stats."""
    repair = repair or RepairStats()
    classes = [
        pb.ClassStats(
            traffic_class=c.traffic_class,
            blocks=c.blocks,
            bytes=c.bytes,
            hits=c.hits,
            misses=c.misses,
            expired=c.expired,
            evicted=c.evicted,
            youngest_evicted_age_s=c.youngest_evicted_age_s,
        )
        for c in stats.classes
    ]
    return pb.StatsReply(
        node_id=node_id,
        epoch=epoch,
        shards=stats.num_shards,
        bytes=stats.shard_bytes,
        capacity_bytes=stats.capacity_bytes,
        corrupt_shards=stats.corrupt_shards,
        classes=classes,
        segments=stats.num_segments,
        hits=stats.hits,
        misses=stats.misses,
        used_bytes=stats.used_bytes,
        index_bytes=stats.index_bytes,
        quarantined_bytes=stats.quarantined_bytes,
        retired_versions=stats.retired_versions,
        repair=pb.RepairStats(
            backlog_shards=repair.backlog_shards,
            rebuilt_shards=repair.rebuilt_shards,
            rebuilt_bytes=repair.rebuilt_bytes,
            read_bytes=repair.read_bytes,
            skipped_expiring=repair.skipped_expiring,
            unrecoverable=repair.unrecoverable,
            fenced=repair.fenced,
            queued_hints=repair.queued_hints,
            passes=repair.passes,
            led_groups=repair.led_groups,
        ),
    )


async def _upkeep(
    holder: StoreHolder, auth: Authenticator, period_s: float, executor: ThreadPoolExecutor
) -> None:
    """Retention caps from the (re-read) credentials file, expiry, refresh persistence,
    capacity checks and queued erases, forever; errors are logged, not fatal."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period_s)
        store = holder.store
        if store is None:
            continue
        try:
            caps = auth.current().tenant_to_max_ttl_s
            await loop.run_in_executor(executor, store.set_retention_caps, caps)
            await loop.run_in_executor(executor, store.tick)
        except IndexUnusable as exc:
            holder.rebuild_after(exc)
        except Exception:
            log.exception("upkeep tick failed; retrying next period")


def _server_options(node: NodeConfig) -> list[tuple[str, int]]:
    limit = node.max_batch_bytes + MESSAGE_SLACK_BYTES
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # A second process must not share our port (gRPC sets SO_REUSEPORT by default, and
        # the kernel then splits the connections between the two processes).
        ("grpc.so_reuseport", 0),
    ]


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Listen on ``address`` (TLS when ``credentials`` are given); Unavailable if the port is
    taken (gRPC either raises or returns port 0 for that, depending on its version)."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise Unavailable(
            f"cannot listen on {address}: the port is taken (another node or program holds "
            "it) or the host is not an address of this machine; free the port or change "
            "address in cluster.toml"
        )
    return port


def _open(
    cluster: ClusterConfig, node: NodeConfig, clock: Clock, auth: Authenticator, placed: PlacedMap
) -> ShardStore:
    store = open_store(cluster, node, clock, placed)
    try:
        store.set_retention_caps(auth.current().tenant_to_max_ttl_s)
    except BaseException:
        store.close()
        raise
    return store


async def serve(
    cluster: ClusterConfig,
    node: NodeConfig,
    stop: asyncio.Event,
    membership: EtcdMembership | None = None,
) -> None:
    """Run one node until ``stop`` is set, then shut down cleanly. With ``membership`` the
    node registers in etcd, follows the map's epochs and takes its turn keeping the map."""
    executor = ThreadPoolExecutor(NUM_WORKER_THREADS, thread_name_prefix=f"node-{node.id}")
    clock = make_clock(cluster.ttl.time_scale, cluster.ttl.origin_unix_s)
    auth = Authenticator(node.credentials_file or None)
    credentials = server_credentials(cluster, node)
    placed = PlacedMap(cluster, node.id)
    holder = StoreHolder(partial(_open, cluster, node, clock, auth, placed), node, executor)
    sync = TombstoneSync(cluster, node, lambda: holder.store, executor)
    repair = RepairService(cluster, node, clock)
    health = health_aio.HealthServicer()
    metrics = NodeMetrics(holder.stats, lambda: repair.stats)
    server = grpc.aio.server(options=_server_options(node))
    ucx = _start_ucx(node)
    servicer = NodeServicer(
        holder, node, cluster.epoch, metrics, executor, ucx, auth, repair, lambda: sync.synced
    )
    servicer.register(server)
    add_HealthServicer_to_server(health, server)
    await health.set("", HealthCheckResponse.NOT_SERVING)

    drops: set[asyncio.Future[int]] = set()

    def drop_moved_away() -> None:
        """With a settled map (etcd membership), drop the shards a finished move placed
        elsewhere (verified on their new nodes before the keeper finished it)."""
        store = holder.store
        if membership is None or placed.cluster.moving_from or store is None:
            return
        drop = asyncio.get_running_loop().run_in_executor(
            executor, store.drop_moved, placed.group_to_position, len(placed.cluster.groups)
        )
        drops.add(drop)
        drop.add_done_callback(drops.discard)

    def follow(new: ClusterConfig) -> None:
        """Switch to a newer map epoch without a restart (etcd membership)."""
        placed.set(new)
        servicer.set_epoch(new.epoch)
        repair.set_cluster(new)
        sync.set_cluster(new)
        log.info("node %s follows map epoch %d", node.id, new.epoch)
        drop_moved_away()

    local = _start_local(node, servicer, executor)  # reads are Unavailable until it opened
    tasks: list[asyncio.Task[None]] = []
    try:
        bind(server, node.address, credentials)
        await server.start()  # Health answers (serving = false) while the store opens
        if node.metrics_port:
            _serve_metrics(metrics, node, auth, lambda: holder.store is not None)
        await holder.open()
        drop_moved_away()  # a move may have finished while this node was down
        period_s = upkeep_period_s(cluster.ttl.time_scale, cluster.ttl.expiry_window_s)
        tasks = [
            asyncio.create_task(_upkeep(holder, auth, period_s, executor)),
            asyncio.create_task(scrub_forever(partial(_scrub, holder), node, executor)),
            asyncio.create_task(sync_forever(sync, node.tombstone_sync_interval_s)),
            asyncio.create_task(repair.run()),
            asyncio.create_task(_mirror_health(health, holder)),
        ]
        if membership is not None:
            info = {"address": node.address, "pid": os.getpid(), "state": "serving"}
            tasks += [
                asyncio.create_task(membership.keep_registered(node.id, info)),
                asyncio.create_task(follow_map(membership, cluster.epoch, follow)),
                asyncio.create_task(
                    keep_map(membership, node.id, lambda: placed.cluster, repair, clock)
                ),
            ]
        log.info("node %s serving on %s", node.id, node.address)
        print(f"node {node.id} serving on {node.address}", flush=True)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not tasks:
            await sync.close()  # sync_forever closes it otherwise
        await health.enter_graceful_shutdown()
        await server.stop(STOP_GRACE_S)
        if ucx is not None:
            await ucx.close()  # no more UCX requests come in
            await servicer.cancel_ucx_requests()  # before the store closes under them
        if local is not None:  # no more local reads; close waits for those in progress
            await asyncio.get_running_loop().run_in_executor(None, local.close)
            await local.finish_delayed()
        await asyncio.gather(*drops, return_exceptions=True)
        await repair.close()
        metrics.close()
        await holder.close()
        executor.shutdown()
    log.info("node %s stopped", node.id)


async def _mirror_health(health: health_aio.HealthServicer, holder: StoreHolder) -> None:
    """grpc.health.v1 says what Health says: SERVING while the store is open, NOT_SERVING
    while it is opened or its index rebuilt (standard probes see it within HEALTH_POLL_S)."""
    serving = None
    while True:
        now_serving = holder.store is not None
        if now_serving != serving:
            status = HealthCheckResponse.SERVING if now_serving else HealthCheckResponse.NOT_SERVING
            for service in ("", SERVICE_NAME):
                await health.set(service, status)
            serving = now_serving
        await asyncio.sleep(HEALTH_POLL_S)


def _serve_metrics(
    metrics: NodeMetrics, node: NodeConfig, auth: Authenticator, is_serving: Callable[[], bool]
) -> None:
    """Metrics and /healthz on ``metrics_port`` (answering 503 while the store opens)."""
    try:
        metrics.serve(
            node.host,
            node.metrics_port,
            is_serving,
            authorize=_metrics_authorizer(node, auth),
        )
    except OSError as exc:
        raise Unavailable(
            f"cannot listen on {node.host}:{node.metrics_port} (metrics_port): the port is "
            f"taken ({exc}); free it or change metrics_port in cluster.toml"
        ) from None


def _scrub(holder: StoreHolder, max_bytes: int) -> ScrubStep:
    """One scrub step of the current store (none while it is rebuilt)."""
    store = holder.store
    return store.scrub(max_bytes) if store is not None else ScrubStep(0, pass_done=True)


def _metrics_authorizer(node: NodeConfig, auth: Authenticator) -> Callable[[str], bool] | None:
    """With ``metrics_auth``: /metrics answers only an admin or node bearer token."""
    if not node.metrics_auth:
        return None

    def authorize(header: str) -> bool:
        try:
            principal = auth.authenticate(bearer_token({"authorization": header}))
            principal.require(Role.ADMIN, Role.NODE)
        except KVStoreError:
            return False
        return True

    return authorize


def _start_local(
    node: NodeConfig, servicer: NodeServicer, executor: ThreadPoolExecutor
) -> LocalServer | None:
    """The node's local read server unless ``node.local_reads`` is "off" or it cannot start."""
    if node.local_reads == "off":
        return None
    try:
        local = LocalServer(
            node.id,
            servicer.open_local_session,
            servicer.serve_local_read,
            delay_s=node.inject_delay_ms / 1000.0,
            loop=asyncio.get_running_loop(),
            executor=executor,
        )
    except OSError as exc:
        log.warning("node %s serves no local reads: %s", node.id, exc)
        return None
    servicer.local_socket = local.socket_name
    return local


def _start_ucx(node: NodeConfig) -> UcxServer | None:
    """The node's UCX sender when ``node.ucx`` allows it and ucxx works here; else None."""
    if node.ucx == "off" or not ucx_available():
        return None
    try:
        return UcxServer()
    except KVStoreError as exc:
        log.warning("node %s serves reads over gRPC only: UCX did not start: %s", node.id, exc)
        return None


async def _main(cluster: ClusterConfig, node: NodeConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if not cluster.membership.endpoints:
        await serve(cluster, node, stop)
        return
    async with EtcdMembership(cluster.membership) as membership:
        # The map in etcd wins over the file (the file seeds etcd's first map): a node that
        # joined later is only in etcd's map.
        cluster = await membership.create_map(cluster)
        await serve(cluster, cluster.node(node.id), stop, membership)


def _node_of(cluster: ClusterConfig, node_id: str) -> NodeConfig:
    """The node's entry in the file's map; with etcd a placeholder for a node only etcd knows
    (``_main`` takes the real entry from etcd's map)."""
    try:
        return cluster.node(node_id)
    except ValueError:
        if not cluster.membership.endpoints:
            raise
        return dataclasses.replace(cluster.nodes[0], id=node_id)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="path of the cluster's cluster.toml")
    parser.add_argument("--id", required=True, help="id of this node in the cluster map")
    parser.add_argument(
        "--inject-delay-ms",
        type=float,
        default=None,
        help="sleep this long in every data RPC (a straggler, for tests and benchmarks)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        cluster = load_cluster(args.config)
        node = _node_of(cluster, args.id)
        if args.inject_delay_ms is not None:
            node = dataclasses.replace(node, inject_delay_ms=args.inject_delay_ms)
    except ValueError as exc:
        print(f"kvstore node: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_main(cluster, node))
    except (RuntimeError, OSError, ValueError, KVStoreError) as exc:  # port, data_dir, files
        log.error("node %s failed: %s", node.id, exc)
        print(f"kvstore node {node.id}: {exc}", file=sys.stderr)
        return 1
    return 0
