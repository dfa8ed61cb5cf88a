"""One storage node's process: its store, its three faces and its background work, started
and stopped together.

``kvstore node --config DIR/cluster.toml --id ID [--inject-delay-ms MS]`` runs it in the
foreground: it binds ``NodeConfig.address`` (refusing a port another process holds: no
SO_REUSEPORT, and the bind's result is checked) and answers Health with ``serving = false``
while it recovers the store (rebuilding a lost or damaged index from the segments,
kvstore/store/index_rebuild.py, or migrating an old one). Then it runs one expiry pass, serves
every RPC, Prometheus on ``metrics_port`` (0 = off), prints ``node <id> serving on <address>``,
and on SIGTERM or SIGINT finishes in-flight requests, persists pending TTL refreshes and closes
the index. In the background it runs upkeep ticks (kvstore/node/upkeep.py, which also apply the
tenants' retention caps), the scrub (kvstore/store/scrub.py), the pull of its peers' delete
logs (kvstore/node/tombstones.py) and the repair service (kvstore/node/repair_service.py); with
etcd membership it also registers, follows the map's epochs and takes its turn keeping the map.

The parts: the store and what holds it across index rebuilds (kvstore/node/store_holder.py),
the gRPC face (kvstore/node/servicer.py), the local channel (kvstore/node/local_face.py over
kvstore/node/local_server.py) and UCX (kvstore/node/ucx_face.py over
kvstore/node/ucx_server.py), whose reads all go through one read routine
(kvstore/node/reads.py).

Message sizes: gRPC's send and receive limits are ``max_batch_bytes`` plus 1 MiB of slack for
framing. A put whose shards add up to more than ``max_batch_bytes`` but fit the slack gets
INVALID_ARGUMENT from the store; a larger message is refused by gRPC itself with
RESOURCE_EXHAUSTED before it reaches the node. Reads check their reply size themselves
(kvstore/node/reads.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
from grpc_health.v1.health import aio as health_aio
from grpc_health.v1.health_pb2 import HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server

from kvstore.auth import Authenticator, NodePeers, Role, bearer_token
from kvstore.config import ClusterConfig, NodeConfig, load_cluster
from kvstore.errors import KVStoreError, Unavailable
from kvstore.map_cache import fallback_map, save_cached_map
from kvstore.membership import EtcdMembership, follow_map
from kvstore.node.local_face import LocalFace
from kvstore.node.local_server import LocalServer
from kvstore.node.map_keeper import keep_map
from kvstore.node.metrics import NodeMetrics
from kvstore.node.reads import NodeReads
from kvstore.node.repair_service import RepairService
from kvstore.node.scrubber import scrub_forever
from kvstore.node.servicer import SERVICE_NAME, NodeServicer
from kvstore.node.store_holder import PlacedMap, StoreHolder, open_store
from kvstore.node.stream_server import StreamServer
from kvstore.node.tombstones import TombstoneSync, sync_forever
from kvstore.node.ucx_face import UcxFace
from kvstore.node.ucx_server import UcxServer
from kvstore.node.upkeep import upkeep_forever, upkeep_period_s
from kvstore.store.scrub import ScrubStep
from kvstore.store.shard_store import ShardStore
from kvstore.tls import server_credentials, stream_server_context
from kvstore.wire.ucx_worker import ucx_available
from ttl.clock import Clock, make_clock

log = logging.getLogger(__name__)

MESSAGE_SLACK_BYTES = 1 << 20
NUM_WORKER_THREADS = 8
STOP_GRACE_S = 5.0


async def serve(
    cluster: ClusterConfig,
    node: NodeConfig,
    stop: asyncio.Event,
    membership: EtcdMembership | None = None,
    cluster_toml: str | None = None,
) -> None:
    """Run one node until ``stop`` is set, then shut down cleanly. With ``membership`` the
    node registers in etcd, follows the map's epochs (caching each beside ``cluster_toml``)
    and takes its turn keeping the map."""
    process = _NodeProcess(cluster, node, membership, cluster_toml)
    await process.health.set("", HealthCheckResponse.NOT_SERVING)
    process.start_local()  # reads are Unavailable until the store opened
    tasks: list[asyncio.Task[None]] = []
    try:
        await process.start()
        tasks = process.start_background()
        log.info("node %s serving on %s", node.id, node.address)
        print(f"node {node.id} serving on {node.address}", flush=True)
        await stop.wait()
    finally:
        await process.stop(tasks)
    log.info("node %s stopped", node.id)


class _NodeProcess:
    """The parts of one running node, wired together; :func:`serve` starts and stops them."""

    def __init__(
        self,
        cluster: ClusterConfig,
        node: NodeConfig,
        membership: EtcdMembership | None,
        cluster_toml: str | None = None,
    ) -> None:
        self.cluster, self.node, self.membership = cluster, node, membership
        self.cluster_toml = cluster_toml
        self.executor = ThreadPoolExecutor(NUM_WORKER_THREADS, thread_name_prefix=f"node-{node.id}")
        self.clock = make_clock(cluster.ttl.time_scale, cluster.ttl.origin_unix_s)
        self.auth = Authenticator(node.credentials_file or None)
        self.credentials = server_credentials(cluster, node)
        self.placed = PlacedMap(cluster, node.id)
        opener = partial(_open, cluster, node, self.clock, self.auth, self.placed)
        self.holder = StoreHolder(opener, node, self.executor)
        self.sync = TombstoneSync(cluster, node, lambda: self.holder.store, self.executor)
        self.repair = RepairService(
            cluster, node, self.clock, self.repair_ready, self.sync.note_peer_seqs
        )
        self.health = health_aio.HealthServicer()
        known = (lambda: self.auth.current().known_tenants) if self.auth.enabled else None
        self.metrics = NodeMetrics(self.holder.stats, lambda: self.repair.stats, known)
        self.server = grpc.aio.server(options=_server_options(node))
        self.reads = NodeReads(self.holder, node, self.metrics, self.auth, self.executor)
        self.ucx = _start_ucx(node)
        self.ucx_face = self._ucx_face()
        self.servicer = self._servicer()
        self.local: LocalServer | None = None
        self.stream: StreamServer | None = None
        self.drops: set[asyncio.Future[int]] = set()

    def repair_ready(self) -> bool:
        """Serving, and the peers' delete logs pulled into this store (Health repair_ready)."""
        return self.holder.store is not None and self.sync.synced

    def _ucx_face(self) -> UcxFace | None:
        if self.ucx is None:
            return None
        return UcxFace(self.ucx, self.reads, self.metrics, self.node.inject_delay_ms / 1000.0)

    def _servicer(self) -> NodeServicer:
        """The gRPC face, with grpc.health.v1 beside it on the node's server."""
        servicer = NodeServicer(
            self.holder,
            self.reads,
            self.node,
            self.cluster.epoch,
            self.metrics,
            self.executor,
            self.ucx,
            self.auth,
            self.repair,
            lambda: self.sync.synced,
            NodePeers(self.cluster.tls.client_certs == "require", self._member_ids),
            lambda: len(self.placed.cluster.groups),
            self.ucx_face.sessions if self.ucx_face is not None else None,
        )
        servicer.register(self.server)
        add_HealthServicer_to_server(self.health, self.server)
        return servicer

    def _member_ids(self) -> frozenset[str]:
        """The node ids of the map this node follows (a node credential comes from one)."""
        return frozenset(n.id for n in self.placed.cluster.nodes)

    def start_local(self) -> None:
        """The local read server (unless off or it cannot start); Health tells its socket."""
        self.local = _start_local(self.node, LocalFace(self.reads, self.metrics), self.executor)
        if self.local is not None:
            self.servicer.local_socket = self.local.socket_name
        self.stream = _start_stream(
            self.cluster, self.node, LocalFace(self.reads, self.metrics), self.executor
        )
        if self.stream is not None:
            self.servicer.stream_port = self.stream.port

    async def start(self) -> None:
        """Listen (Health answers serving = false meanwhile), then open the store."""
        bind(self.server, self.node.address, self.credentials)
        await self.server.start()
        if self.node.metrics_port:
            _serve_metrics(
                self.metrics, self.node, self.auth, lambda: self.holder.store is not None
            )
        await self.holder.open()
        self.drop_moved_away()  # a move may have finished while this node was down

    def start_background(self) -> list[asyncio.Task[None]]:
        """The node's background work, as tasks :meth:`stop` cancels."""
        ttl = self.cluster.ttl
        period_s = upkeep_period_s(ttl.time_scale, ttl.expiry_window_s)
        work = [
            upkeep_forever(self.holder, self.auth, period_s, self.executor),
            scrub_forever(
                partial(_scrub, self.holder), self.node, self.executor, self.holder.rebuild_after
            ),
            sync_forever(self.sync, self.node.tombstone_sync_interval_s, self.holder),
            self.repair.run(),
            _mirror_health(self.health, self.holder),
        ]
        return [asyncio.create_task(w) for w in work + self._membership_work()]

    def _membership_work(self) -> list[Coroutine[Any, Any, None]]:
        """With etcd membership: stay registered, follow the map, take turns keeping it."""
        membership, node = self.membership, self.node
        if membership is None:
            return []
        info = {"address": node.address, "pid": os.getpid(), "state": "serving"}
        return [
            membership.keep_registered(node.id, info),
            follow_map(membership, self.cluster.epoch, self.follow),
            keep_map(membership, node.id, lambda: self.placed.cluster, self.repair, self.clock),
        ]

    def follow(self, new: ClusterConfig) -> None:
        """Switch to a newer map epoch without a restart (etcd membership)."""
        self.placed.set(new)
        self.servicer.set_epoch(new.epoch)
        self.repair.set_cluster(new)
        self.sync.set_cluster(new)
        if self.cluster_toml is not None:
            save_cached_map(self.cluster_toml, new)
        log.info("node %s follows map epoch %d", self.node.id, new.epoch)
        self.drop_moved_away()

    def drop_moved_away(self) -> None:
        """With a settled map (etcd membership), drop the shards a finished move placed
        elsewhere (verified on their new nodes before the keeper finished it)."""
        store, placed = self.holder.store, self.placed
        if self.membership is None or placed.cluster.moving_from or store is None:
            return
        drop = asyncio.get_running_loop().run_in_executor(
            self.executor, store.drop_moved, placed.group_to_position, len(placed.cluster.groups)
        )
        self.drops.add(drop)
        drop.add_done_callback(self.drops.discard)

    async def stop(self, tasks: list[asyncio.Task[None]]) -> None:
        """Stop the background work, then the faces, then close the store."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not tasks:
            await self.sync.close()  # sync_forever closes it otherwise
        await self.health.enter_graceful_shutdown()
        await self.server.stop(STOP_GRACE_S)
        await self._stop_other_faces()
        await asyncio.gather(*self.drops, return_exceptions=True)
        await self.repair.close()
        self.metrics.close()
        await self.holder.close()
        self.executor.shutdown()

    async def _stop_other_faces(self) -> None:
        """UCX and local reads end before the store closes under them."""
        if self.ucx_face is not None:
            await self.ucx_face.close()
        for server in (self.local, self.stream):  # no more local or stream reads; close
            if server is not None:  # waits for those in progress
                await asyncio.get_running_loop().run_in_executor(None, server.close)
                await server.finish_delayed()


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


async def _mirror_health(health: health_aio.HealthServicer, holder: StoreHolder) -> None:
    """grpc.health.v1 says what Health says: SERVING while the store is open, NOT_SERVING
    while it is opened or its index rebuilt (woken by the holder's changes, not a poll)."""
    serving = None
    while True:
        generation = holder.generation
        now_serving = holder.store is not None
        if now_serving != serving:
            status = HealthCheckResponse.SERVING if now_serving else HealthCheckResponse.NOT_SERVING
            for service in ("", SERVICE_NAME):
                await health.set(service, status)
            serving = now_serving
        await holder.changed_since(generation)


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
    """With ``metrics_auth``, or any auth: /metrics answers only an admin or node bearer
    token (it names tenants, which a node with credentials must not tell strangers)."""
    if not (node.metrics_auth or auth.enabled):
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
    node: NodeConfig, face: LocalFace, executor: ThreadPoolExecutor
) -> LocalServer | None:
    """The node's local read server unless ``node.local_reads`` is "off" or it cannot start."""
    if node.local_reads == "off":
        return None
    try:
        return LocalServer(
            node.id,
            face.open_session,
            face.read,
            delay_s=node.inject_delay_ms / 1000.0,
            loop=asyncio.get_running_loop(),
            executor=executor,
        )
    except OSError as exc:
        log.warning("node %s serves no local reads: %s", node.id, exc)
        return None


def _start_stream(
    cluster: ClusterConfig, node: NodeConfig, face: LocalFace, executor: ThreadPoolExecutor
) -> StreamServer | None:
    """The node's stream read server on its address's host, unless ``node.stream_reads`` is
    "off" or it cannot start (Health then tells no port and clients read over gRPC)."""
    if node.stream_reads == "off":
        return None
    try:
        return StreamServer(
            node.id,
            node.address.rpartition(":")[0],
            node.stream_port,
            face.open_session,
            face.read,
            partial(stream_server_context, cluster, node),
            delay_s=node.inject_delay_ms / 1000.0,
            loop=asyncio.get_running_loop(),
            executor=executor,
        )
    except OSError as exc:
        log.warning("node %s serves no stream reads: %s", node.id, exc)
        return None


def _start_ucx(node: NodeConfig) -> UcxServer | None:
    """The node's UCX sender when ``node.ucx`` allows it and ucxx works here; else None."""
    if node.ucx == "off" or not ucx_available():
        return None
    try:
        return UcxServer()
    except KVStoreError as exc:
        log.warning("node %s serves reads over gRPC only: UCX did not start: %s", node.id, exc)
        return None


async def _main(cluster: ClusterConfig, node: NodeConfig, cluster_toml: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if not cluster.membership.endpoints:
        await serve(cluster, node, stop)
        return
    async with EtcdMembership(cluster.membership) as membership:
        cluster = await _map_to_start_on(membership, cluster, cluster_toml)
        await serve(cluster, cluster.node(node.id), stop, membership, cluster_toml)


async def _map_to_start_on(
    membership: EtcdMembership, seed: ClusterConfig, cluster_toml: str
) -> ClusterConfig:
    """The map in etcd, which wins over the file (the file seeds etcd's first map: a node that
    joined later is only in etcd's map); while etcd does not answer, the last map read from it
    (kvstore/map_cache.py) or the file's, whichever is newer: the node follows etcd's map
    once etcd answers."""
    try:
        cluster = await membership.create_map(seed)
    except Unavailable as exc:
        cluster = fallback_map(cluster_toml, seed)
        log.warning("%s: starting on the cached map, epoch %d", exc, cluster.epoch)
        return cluster
    save_cached_map(cluster_toml, cluster)
    return cluster


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
        asyncio.run(_main(cluster, node, args.config))
    except (RuntimeError, OSError, ValueError, KVStoreError) as exc:  # port, data_dir, files
        log.error("node %s failed: %s", node.id, exc)
        print(f"kvstore node {node.id}: {exc}", file=sys.stderr)
        return 1
    return 0
