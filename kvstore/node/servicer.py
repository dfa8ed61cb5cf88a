"""The node's gRPC face: every RPC of ``kvstore.v1.ShardStore``, a thin shell over the store.

It finds the caller's principal from its credential (a bearer token or a verified mTLS client
certificate, kvstore/auth.py; every RPC but Health, which tells only the node's id, epoch and
clock, so health checkers need no secret), derives the tenant from it (a request naming another
tenant is PERMISSION_DENIED before the store is touched), injects the straggler delay, runs the
store call in the node's one thread pool (reads overlap, writes serialize inside the store;
GetShards and ReadBatch go through the node's read routine, kvstore/node/reads.py, which runs
small reads on the event loop) and maps kvstore errors to gRPC status codes through
:func:`kvstore.grpc_errors.to_grpc_status` only. An index found unusable by any RPC takes the
node back to ``serving = false`` while it is rebuilt (kvstore/node/store_holder.py).

A node principal (a peer's repair service) may read any tenant's shards and write repair puts,
as it holds those tenants' shards on its own disk anyway; it may not write ordinary puts,
delete or purge, and its repair puts may only re-create a version k other members of the
group hold (kvstore/node/repair_service.py): a node credential cannot mint a block. A node
takes repair puts, and lists its shards for repair, only once it has pulled its peers' delete
logs since it started, so a repair cannot bring back a block deleted while this node was away.

Unary ``GetShards`` stays for tools that want protobuf replies, and for the repair service's
reads of single shards; its replies are encoded by
:func:`kvstore.node.get_reply.encode_get_shards_reply` with one copy of each shard instead of
protobuf's two. ``ReadBatch`` streams the batch answer of the client's data plane.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.auth import Authenticator, NodePeers, Principal, Role, bearer_token
from kvstore.config import NodeConfig
from kvstore.errors import IndexUnusable, InvalidArgument, PermissionDenied, Unavailable
from kvstore.grpc_errors import to_grpc_status
from kvstore.node.admission import Admission
from kvstore.node.get_reply import encode_get_shards_reply
from kvstore.node.metrics import NodeMetrics
from kvstore.node.reads import NodeReads
from kvstore.node.repair_service import RepairService, RepairStats
from kvstore.node.stats import node_stats_reply
from kvstore.node.store_holder import StoreHolder
from kvstore.node.tombstones import MAX_TOMBSTONES_PER_REPLY
from kvstore.node.ucx_server import UcxServer
from kvstore.node.ucx_sessions import UcxSessions
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.index_codec import Entry
from kvstore.store.request_checks import (
    MAX_HINTS_PER_REQUEST,
    check_below,
    check_count,
    check_keys,
    check_seconds,
    check_tenant,
)
from kvstore.store.shard_store import PutOptions
from kvstore.tls import peer_certificate
from kvstore.wire import batch_answer, local_frames
from kvstore.wire.answer_message import InPlaceAnswer
from kvstore.wire.put_request import PutRequestView, parse_put_request

log = logging.getLogger(__name__)

# Cheap RPCs, answered on the event loop even when the pool is busy (a restarted node's
# repair fills it): a probe or a session open that waited there would mark the node suspect.
_ANSWERED_INLINE = frozenset({"Health", "Stats", "OpenUcxSession"})

SERVICE_NAME = "kvstore.v1.ShardStore"
REPAIR_CONFIRM_TIMEOUT_S = 30.0  # a repair write's listing of its group (PEER_TIMEOUT_S is 10)
MAX_LIST_PAGE = 4096

Handler = Callable[[Any, Principal], Message | bytes]
Parser = Callable[[bytes], Any]  # raw request bytes -> the request a handler takes


class NodeServicer:
    """The gRPC face of one node's store.

    Requests arrive as raw bytes and are parsed here, so a malformed message gets
    INVALID_ARGUMENT (gRPC's own deserializer would answer UNKNOWN). Every handler gets the
    caller's principal and checks it first.
    """

    def __init__(
        self,
        holder: StoreHolder,
        reads: NodeReads,
        node: NodeConfig,
        epoch: int,
        metrics: NodeMetrics,
        executor: ThreadPoolExecutor,
        ucx: UcxServer | None = None,
        auth: Authenticator | None = None,
        repair: RepairService | None = None,
        deletes_synced: Callable[[], bool] = lambda: True,
        node_peers: NodePeers | None = None,
        num_groups: Callable[[], int] = lambda: 1 << 32,
        ucx_sessions: UcxSessions | None = None,
    ) -> None:
        self._holder = holder
        self._reads = reads
        self._repair = repair
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, for repair checks
        self._deletes_synced = deletes_synced
        self._incarnation = time.time_ns()
        self._auth = auth or Authenticator(None)
        self._node_peers = node_peers or NodePeers(False, frozenset)
        self._num_groups = num_groups  # placement groups of the map the node follows
        self._ucx = ucx
        self._ucx_sessions = ucx_sessions
        self._node = node
        self._epoch = epoch
        self._metrics = metrics
        self._executor = executor
        self._delay_s = node.inject_delay_ms / 1000.0
        self.local_socket = ""  # the local read server's socket, once the node started it
        self.stream_port = 0  # the stream read server's TCP port, once the node started it
        self._boot_id = local_frames.boot_id()
        self.admission = Admission(node.id)  # sheds data RPCs that would outlast their deadline
        self._unary = {
            # Parsed by hand: protobuf would copy every shard twice (kvstore/wire/put_request.py).
            "PutShards": (parse_put_request, self._put, True),
            "GetShards": (pb.GetShardsRequest.FromString, self._get, True),
            "Contains": (pb.ContainsRequest.FromString, self._contains, True),
            "Delete": (pb.DeleteRequest.FromString, self._delete, True),
            "Purge": (pb.PurgeRequest.FromString, self._purge, False),
            "ListTombstones": (pb.ListTombstonesRequest.FromString, self._list_tombstones, False),
            "Stats": (pb.StatsRequest.FromString, self._stats, False),
            "Health": (pb.HealthRequest.FromString, self._health, False),
            "TouchShards": (pb.TouchShardsRequest.FromString, self._touch, True),
            "ListShards": (pb.ListShardsRequest.FromString, self._list, False),
            "QueueRepair": (pb.QueueRepairRequest.FromString, self._queue_repair, False),
            "InspectShards": (pb.InspectShardsRequest.FromString, self._inspect, False),
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
        handlers["OpenUcxSession"] = grpc.unary_unary_rpc_method_handler(
            self._open_ucx_session_call, response_serializer=_serialize
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )

    def _unary_method(self, rpc: str) -> Callable[[bytes, Any], Awaitable[Any]]:
        parse, handler, delay = self._unary[rpc]

        async def method(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await self._serve(rpc, context, parse, handler, raw, delay=delay)

        return method

    async def _read_batch_stream(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """ReadBatch: the batch answer as ReadBatchChunk messages (kvstore/wire/batch_answer.py)."""
        chunks = await self._serve(
            "ReadBatch",
            context,
            pb.GetShardsRequest.FromString,
            self._read_batch_chunks,
            raw,
            delay=True,
        )
        for chunk in chunks:
            yield chunk

    async def _open_ucx_session_call(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> pb.UcxSessionReply:
        """OpenUcxSession: the session remembers the call's bearer token (checked again on
        every UCX read) when the token is what authenticated it, else its principal."""
        token = bearer_token(dict(context.invocation_metadata() or ()))

        def open_session(request: pb.UcxSessionRequest, principal: Principal) -> Message:
            return self._open_ucx_session(token, principal)

        parse = pb.UcxSessionRequest.FromString
        reply = await self._serve("OpenUcxSession", context, parse, open_session, raw, delay=False)
        assert isinstance(reply, pb.UcxSessionReply)
        return reply

    def _open_ucx_session(self, token: str | None, principal: Principal) -> pb.UcxSessionReply:
        if principal.role is Role.NODE:
            raise PermissionDenied("a node credential does not read over UCX")
        principal.require(Role.TENANT, Role.SERVICE)
        if self._ucx_sessions is None:
            raise Unavailable(f"node {self._node.id} serves no reads over UCX")
        by_token = token is not None and self._auth.enabled and self._token_is(token, principal)
        session_id, session = self._ucx_sessions.open(token if by_token else principal)
        return pb.UcxSessionReply(
            session_id=session_id, key=session.key, expires_in_s=self._ucx_sessions.ttl_s
        )

    def _token_is(self, token: str, principal: Principal) -> bool:
        """Whether ``token`` alone authenticates as ``principal`` (not a certificate)."""
        try:
            return self._auth.authenticate(token) == principal
        except PermissionDenied:
            return False

    async def _serve(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext,
        parse: Parser,
        handler: Handler,
        raw: bytes,
        *,
        delay: bool,
    ) -> Message | bytes:
        """Authenticate, delay (straggler), parse and run ``handler`` in the pool, map errors."""
        start_s = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        code, details, reply = grpc.StatusCode.OK, "", None
        admitted = False
        try:
            principal = self._principal(context) if rpc != "Health" else None
            self.admission.admit(rpc, context.time_remaining(), time.monotonic())  # shedding
            admitted = True
            if delay and self._delay_s:
                await asyncio.sleep(self._delay_s)
            reply = await self._run(rpc, parse, handler, raw, principal)
        except Exception as exc:
            if isinstance(exc, IndexUnusable):
                self._holder.rebuild_after(exc)
            code, details = to_grpc_status(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", rpc)
        finally:  # a call its client cancelled ends here too
            if admitted:
                self.admission.finished(rpc, time.perf_counter() - start_s)
        self._metrics.observe(rpc, code, time.perf_counter() - start_s)
        if reply is None:
            await context.abort(code, details)
        return reply

    async def _run(
        self,
        rpc: str,
        parse: Parser,
        handler: Handler,
        raw: bytes,
        principal: Principal | None,
    ) -> Any:
        """Parse and handle ``raw``: reads where the read routine runs them, the rest in the
        pool."""
        if rpc in _ANSWERED_INLINE:
            return _parse_and_call(rpc, parse, handler, raw, principal)
        if handler not in (self._get, self._read_batch_chunks):
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, _parse_and_call, rpc, parse, handler, raw, principal
            )
        request = _parse(rpc, parse, raw)  # a get request holds keys only: cheap to parse
        return await self._reads.run(len(request.keys), handler, request, principal)

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """Who the call comes from: its mTLS certificate's name or its bearer token; a node
        principal only from a member node's certificate under mTLS (kvstore/auth.py)."""
        if not self._auth.enabled:
            return self._auth.authenticate(None)
        metadata = dict(context.invocation_metadata() or ())
        cert = peer_certificate(context)
        principal = self._auth.authenticate(bearer_token(metadata), cert)
        self._node_peers.check(principal, cert)
        return principal

    def _put(self, parsed: PutRequestView, principal: Principal) -> pb.PutShardsReply:
        """PutShards: the shards are views of the received message (no copy on the node)."""
        request = parsed.fields  # every field but the shards
        if request.repair:
            tenant = principal.tenant_for_repair(request.tenant)
            self._require_deletes_synced("takes repair writes")
            if principal.role is Role.NODE:
                self._confirm_repair(tenant, parsed)
        else:
            tenant = principal.tenant_for(request.tenant)
        check_seconds("expires_at_s", request.expires_at_s)
        for i, shard in enumerate(parsed.shards):
            check_seconds(f"shards[{i}].written_at_s", shard.written_at_s)
        items = [(s.key, s.shard) for s in parsed.shards]
        options = PutOptions(
            written_at_s=[s.written_at_s for s in parsed.shards],
            expires_at_s=request.expires_at_s,
            repair=request.repair,
            ttl_s=request.ttl_s,
        )
        result = self._holder.require().put(tenant, request.traffic_class, items, options)
        self._metrics.put_shards.inc(result.num_stored)
        self._metrics.put_bytes.inc(sum(len(shard) for _, shard in items))
        return pb.PutShardsReply(
            num_stored=result.num_stored,
            num_superseded=result.num_superseded,
            num_fenced=result.num_fenced,
        )

    def _confirm_repair(self, tenant: str, parsed: PutRequestView) -> None:
        """A node's repair write re-creates a version its group holds, or is refused
        (kvstore/node/repair_service.py): the check lists the peers, on the event loop, while
        this pool thread waits for it."""
        if self._repair is None or self._loop is None:
            raise Unavailable(f"node {self._node.id} runs no repair service: no repair writes")
        shards = [(s.key, s.shard) for s in parsed.shards]
        check = self._repair.confirm_repair(tenant, shards, parsed.fields.expires_at_s)
        try:
            asyncio.run_coroutine_threadsafe(check, self._loop).result(REPAIR_CONFIRM_TIMEOUT_S)
        except TimeoutError:
            raise Unavailable(
                f"node {self._node.id} could not list its peers to confirm a repair write in "
                f"{REPAIR_CONFIRM_TIMEOUT_S:g} s; retry"
            ) from None

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
        found = self._reads.get(principal, request.tenant, request.keys, request.version)
        return encode_get_shards_reply(found)

    def _read_batch_chunks(self, request: pb.GetShardsRequest, principal: Principal) -> list[bytes]:
        """ReadBatch's answer as ReadBatchChunk messages: one message read in place when the
        answer fits one chunk (kvstore/wire/answer_message.py), else chunks copied from the
        staging."""
        keys = list(request.keys)
        in_place = InPlaceAnswer(len(keys), self._reads.staging.take)
        read = self._reads.read_batch(
            principal, request.tenant, keys, request.version, in_place.take
        )
        try:
            message = in_place.message(read.entries, read.staging, read.payload_bytes)
            if message is not None:
                return [message]
            return batch_answer.encode_chunks(
                batch_answer.encode_table(read.entries), read.payloads
            )
        finally:
            read.release()

    def _contains(self, request: pb.ContainsRequest, principal: Principal) -> pb.ContainsReply:
        store = self._holder.require()
        found = store.contains(principal.tenant_for(request.tenant), list(request.keys))
        return pb.ContainsReply(results=[pb.KeyVersions(versions=v) for v in found])

    def _delete(self, request: pb.DeleteRequest, principal: Principal) -> pb.DeleteReply:
        tenant = principal.tenant_for(request.tenant)
        num_deleted = self._holder.require().delete(tenant, list(request.keys))
        return pb.DeleteReply(num_deleted=num_deleted)

    def _inspect(
        self, request: pb.InspectShardsRequest, principal: Principal
    ) -> pb.InspectShardsReply:
        """``kvstore inspect``: a tenant's (or service's) own keys, or any tenant's for an admin."""
        principal.require(Role.TENANT, Role.SERVICE, Role.ADMIN)
        admin = principal.role is Role.ADMIN  # metadata of any tenant's keys, no bytes
        tenant = request.tenant if admin else principal.tenant_for(request.tenant)
        store = self._holder.require()
        found = store.inspect(tenant, list(request.keys))
        return pb.InspectShardsReply(
            node_id=self._node.id,
            now_s=store.clock.now(),
            results=[pb.InspectedKey(shards=[_inspected(e, ok) for e, ok in f]) for f in found],
        )

    def _touch(self, request: pb.TouchShardsRequest, principal: Principal) -> pb.TouchShardsReply:
        principal.require(Role.TENANT, Role.SERVICE)  # a client's follow-up to its read
        tenant = principal.tenant_for(request.tenant)
        store = self._holder.require()
        num = store.touch(tenant, list(request.keys), list(request.versions))
        return pb.TouchShardsReply(num_touched=num)

    def _list(self, request: pb.ListShardsRequest, principal: Principal) -> pb.ListShardsReply:
        principal.require(Role.NODE, Role.ADMIN)
        self._require_deletes_synced("lists its shards for repair")
        check_below("group", request.group, self._num_groups(), "the map's number of groups")
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
        check_count("hints", len(request.hints), MAX_HINTS_PER_REQUEST)
        num_groups = self._num_groups()
        hints = [(principal.tenant_for_repair(h.tenant), h.key, h.group) for h in request.hints]
        for i, (tenant, key, group) in enumerate(hints):
            check_tenant(tenant)
            check_keys([key])
            check_below(f"hints[{i}].group", group, num_groups, "the map's number of groups")
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
        node = self._node
        stats, store = self._holder.stats(), self._holder.store
        return node_stats_reply(node.id, self._epoch, node.data_dir, stats, store, repair)

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
            node_pid=os.getpid() if self.local_socket else 0,
            stream_port=self.stream_port,
            last_tombstone_seq=store.tombstones(0, 0)[1] if store is not None else 0,
        )


def _inspected(entry: Entry, intact: bool) -> pb.InspectedShard:
    return pb.InspectedShard(
        version=entry.version,
        shard_index=entry.shard_index,
        shard_bytes=entry.shard_bytes,
        traffic_class=entry.traffic_class,
        written_at_s=entry.created_s,
        last_access_s=entry.last_access_s,
        expires_at_s=entry.expires_at_s,
        status=pb.ShardStatus.HIT if intact else pb.ShardStatus.CORRUPT,
    )


def _serialize(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _parse(rpc: str, parse: Parser, raw: bytes) -> Any:
    try:
        return parse(raw)
    except (DecodeError, ValueError) as exc:
        raise InvalidArgument(
            f"malformed {rpc} request: {exc}; build requests from kvstore/proto/kvstore.proto"
        ) from None


def _parse_and_call(
    rpc: str, parse: Parser, handler: Handler, raw: bytes, principal: Principal | None
) -> Message | bytes:
    return handler(_parse(rpc, parse, raw), principal)
