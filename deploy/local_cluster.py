"""A cluster of storage-node processes on 127.0.0.1, for development, tests and benchmarks.

This is the library: :class:`LocalCluster` (start, stop, kill and restart nodes, join, drain
and remove them) and ``cluster.toml`` written by :func:`local_config`; the secrets of a
cluster directory are deploy/local_secrets.py (``secure``), its node processes (ports,
spawning, Health) deploy/local_nodes.py and its pid bookkeeping deploy/local_pids.py. The
``kvstore cluster`` commands (up, status, down, join, drain, remove, add-tenant) are
deploy/cluster_cli.py.

With ``--etcd`` the map lives in etcd (kvstore/membership.py; without an endpoint a local etcd
runs from DIR/etcd, deploy/local_etcd.py), and join, drain and remove change it there
(kvstore/map_changes.py); ``cluster.toml`` is then the seed and a copy of the latest map.

Layout of DIR::

    cluster.toml       the cluster map every node and client reads (written by `up`)
    pids.json          node id -> pid of the running node process
    logs/<id>.log      each node's stdout and stderr (appended across restarts)
    <id>/              each node's data directory
    master.key         with --encrypt: the master key that wraps tenants' data keys (0600)
    keyring.json       with --encrypt: the wrapped data keys (made on a tenant's first put)
    credentials.toml   with --auth: the nodes' principals, tokens hashed (mode 0600)
    integrity.json     with --auth: each tenant's integrity key (0600; client hosts only)
    admin.token        with --auth: the admin credential `up` wrote (0600), for status/purge
    node.token         with --auth: the credential nodes present to each other (0600)
    tls/               with --tls: the development CA and one certificate per node;
    tls/etcd/          with --tls --etcd: etcd's own CA, its certificate and its users' ones
    etcd/, etcd.pid    with --etcd (no endpoint): the local etcd's data and pid
    base_port          with --base-port: the first port; the local etcd and nodes joined
                       later take the ports after the ones in use, never free ones

On one machine the nodes share DIR, so they share one credentials file; on real hosts each
node has its own copy (the same file), and only the nodes can read it.

Each node is its own failure domain; groups come from kvstore.placement.make_groups (one group
per node, rotations of the node list). Programmatic use (tests, benchmarks)::

    with LocalCluster.start(tmp_path, num_nodes=12, time_scale=1.0, fsync=False) as cluster:
        cluster.kill_node("n03"); cluster.restart_node("n03", ["--inject-delay-ms", "50"])
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from deploy.local_etcd import issue_etcd_certs, membership_tls, start_etcd, stop_etcd
from deploy.local_nodes import (
    PORT_ATTEMPTS,
    PORT_TAKEN,
    STARTUP_TIMEOUT_S,
    free_ports,
    new_ports,
    release_ports,
    spawn_node,
    wait_healthy,
)
from deploy.local_pids import (
    STOP_TIMEOUT_S,
    is_node_process,
    read_pids,
    refuse_running,
    write_pids,
)
from deploy.local_secrets import (
    CREDENTIALS_FILE,
    TLS_DIR,
    local_admin_token,
    provision_integrity,
    secure,
)
from kvstore.auth import Role, add_principal
from kvstore.config import (
    ClientConfig,
    ClusterConfig,
    CodecConfig,
    MembershipConfig,
    NodeConfig,
    TTLConfig,
    save_cluster,
)
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.map_changes import drain, join, readdress, remove
from kvstore.membership import EtcdMembership
from kvstore.placement import make_groups
from kvstore.store.shard_store import reserve_bytes_for

log = logging.getLogger(__name__)

LOCAL_ETCD = "local"  # `--etcd` without an endpoint: start one (deploy/local_etcd.py)
BASE_PORT_FILE = "base_port"
DEFAULT_DOWN_OUT_S = 600.0  # Ceph's mon_osd_down_out_interval
DRAIN_TIMEOUT_S = 600.0
# The nodes of a local cluster share one disk, so the index reserve a node takes by default
# (1/32 of its disk, up to 32 MiB: kvstore/store/shard_store.py) would be counted once a node:
# 384 MB of allocated zeros for 12 nodes. A local node's index grows by a few KB a put batch.
LOCAL_INDEX_RESERVE_BYTES = 4 << 20


def local_config(
    root: Path,
    num_nodes: int,
    time_scale: float = 1.0,
    backend: str = "isal",
    base_port: int | None = None,
    **node_defaults: Any,
) -> ClusterConfig:
    """The cluster map of ``num_nodes`` nodes on 127.0.0.1 with data under ``root/<id>``."""
    codec = CodecConfig(backend=backend)
    if num_nodes < codec.num_shards:
        raise InvalidArgument(
            f"--nodes {num_nodes} is too few: a group needs k+m = {codec.num_shards} nodes"
        )
    if base_port is None:
        ports = free_ports(2 * num_nodes)
    else:
        ports = list(range(base_port, base_port + 2 * num_nodes))
    nodes = tuple(
        NodeConfig(
            id=f"n{i:02d}",
            address=f"127.0.0.1:{ports[i]}",
            metrics_port=ports[num_nodes + i],
            failure_domain=f"n{i:02d}",
            data_dir=str(root.resolve() / f"n{i:02d}"),
            **node_defaults,
        )
        for i in range(num_nodes)
    )
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], codec.num_shards)
    ttl = TTLConfig(time_scale=time_scale, origin_unix_s=time.time())
    return ClusterConfig(
        epoch=1, nodes=nodes, groups=tuple(groups), codec=codec, client=ClientConfig(), ttl=ttl
    )


def with_local_reserves(config: ClusterConfig) -> ClusterConfig:
    """``config`` with each node that sets no index reserve given one: the automatic one (of
    its ``max_bytes``, or of its disk: one mounted at its data directory gets 1/32 of it),
    at most :data:`LOCAL_INDEX_RESERVE_BYTES`. Apply it once the limits are final."""

    def reserved(node: NodeConfig) -> NodeConfig:
        if node.index_reserve_bytes:
            return node
        automatic = reserve_bytes_for(node, Path(node.data_dir))
        return dataclasses.replace(
            node, index_reserve_bytes=min(automatic, LOCAL_INDEX_RESERVE_BYTES)
        )

    return dataclasses.replace(config, nodes=tuple(reserved(node) for node in config.nodes))


def node_ports(nodes: Sequence[NodeConfig]) -> list[int]:
    """The ports the nodes listen on: gRPC, then metrics."""
    return [int(n.address.rpartition(":")[2]) for n in nodes] + [n.metrics_port for n in nodes]


def _etcd_client_ports(config: ClusterConfig) -> list[int]:
    ports = [e.rpartition(":")[2] for e in config.membership.endpoints]
    return [int(port) for port in ports if port.isdigit()]


def cluster_ports(config: ClusterConfig) -> list[int]:
    """The ports the map names: its nodes' and its etcd's client ports. (A local etcd's peer
    port is in no map: drawn free, its reservation lasts until this process exits.)"""
    return node_ports(config.nodes) + _etcd_client_ports(config)


def next_ports(root: Path, config: ClusterConfig, count: int) -> list[int] | None:
    """With ``--base-port`` (``root/base_port``): the ``count`` ports after every port the
    cluster uses (its nodes' and its local etcd's); None: the cluster takes free ports."""
    path = root / BASE_PORT_FILE
    if not path.exists():
        return None
    peers = [port + 1 for port in _etcd_client_ports(config)]  # from a base port: client, peer
    first = max([int(path.read_text()) - 1, *cluster_ports(config), *peers]) + 1
    return list(range(first, first + count))


def _on_etcd(root: Path, config: ClusterConfig, etcd: str, down_out_s: float) -> ClusterConfig:
    """``config`` with its map in etcd at ``etcd`` (``"local"``: one started under ``root``,
    over TLS with client certificates when the cluster has TLS, deploy/local_etcd.py; on the
    ports after the nodes' with ``--base-port``), which must hold no map yet: nodes would
    follow an older one, not this one."""
    tls_fields: dict[str, str] = {}
    if etcd == LOCAL_ETCD:
        tls = issue_etcd_certs(root / TLS_DIR / "etcd") if config.tls_enabled else None
        endpoint = start_etcd(root, *(next_ports(root, config, 2) or free_ports(2)), tls=tls)
        tls_fields = membership_tls(tls) if tls else {}
    else:
        endpoint = etcd
    membership = MembershipConfig(etcd=endpoint, down_out_s=down_out_s, **tls_fields)
    config = dataclasses.replace(config, membership=membership)
    try:
        existing = etcd_call(config, _get_map)
    except BaseException:
        stop_etcd(root)
        raise
    if existing is not None:
        stop_etcd(root)
        raise InvalidArgument(
            f"etcd {endpoint} already holds a cluster map under {membership.prefix} "
            f"(epoch {existing.epoch}, {len(existing.nodes)} nodes): its nodes would "
            "follow that map, not this one; use an etcd of its own (--etcd alone "
            "starts one) or remove the old map"
        )
    return config


def _on_new_ports(config: ClusterConfig) -> ClusterConfig:
    """``config`` with every node on fresh ports. With etcd, the nodes of the failed start may
    have stored their map there already (and cached it beside cluster.toml): a node follows
    that map, not the file, so the move is a map change in etcd, at a newer epoch."""
    moved = dataclasses.replace(config, nodes=new_ports(config.nodes))
    release_ports(node_ports(config.nodes))  # the failed start's: its nodes are stopped
    if not config.membership.endpoints:
        return moved

    async def move(membership: EtcdMembership) -> ClusterConfig:
        if await membership.get_map() is None:
            return moved
        return await membership.change_map(
            lambda current: dataclasses.replace(moved, epoch=current.epoch + 1)
        )

    return etcd_call(config, move)


class LocalCluster:
    """Node processes of one local cluster, started and stopped by this process."""

    def __init__(
        self,
        root: Path,
        config: ClusterConfig,
        spawn_prefix: Callable[[str], Sequence[str]] = lambda node_id: (),
    ) -> None:
        self.root = root
        self.config = config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # node id -> the command a node runs through (``ip netns exec NS``: the netns test).
        self.spawn_prefix = spawn_prefix
        self.startup_timeout_s = STARTUP_TIMEOUT_S  # start()'s: added and restarted nodes too

    @property
    def cluster_toml(self) -> Path:
        return self.root / "cluster.toml"

    @property
    def credentials_file(self) -> Path:
        return self.root / CREDENTIALS_FILE

    @property
    def admin_token(self) -> str | None:
        return local_admin_token(self.root)

    def add_tenant(self, tenant: str, role: Role = Role.TENANT, tenants: Sequence[str] = ()) -> str:
        """A new principal's token (``kvstore cluster add-tenant``); nodes see it within 1 s.
        With integrity on, the tenants it acts for get their integrity keys."""
        provision_integrity(self.config.integrity.key_file, tenant, role, tenants)
        return add_principal(self.credentials_file, tenant, role, frozenset(tenants))

    @classmethod
    def start(
        cls,
        root: str | Path,
        num_nodes: int = 12,
        time_scale: float = 1.0,
        *,
        backend: str = "isal",
        base_port: int | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        auth: bool = False,
        tls: bool = False,
        mtls: bool = False,
        encrypt: Sequence[str] = (),
        integrity: bool | None = None,
        etcd: str | None = None,
        down_out_s: float = DEFAULT_DOWN_OUT_S,
        **node_defaults: Any,
    ) -> LocalCluster:
        """Write ``root/cluster.toml``, start every node concurrently, wait until all serve.

        ``node_defaults`` are NodeConfig fields for every node (``fsync=False``,
        ``max_bytes=...``). ``auth`` writes a credentials file with an admin and a node
        principal (``root/admin.token``); ``tls`` a CA and node certificates (``mtls``:
        clients must present one too); ``encrypt`` names tenants whose blocks clients seal
        (a master key and keyring under ``root``); ``integrity`` (default: with ``auth``)
        keyed block versions for every other tenant (client/integrity.py). ``etcd``:
        membership on etcd at that endpoint, or ``"local"`` to start one
        (deploy/local_etcd.py), with ``down_out_s``. On a startup failure the started nodes
        (and a started etcd) are stopped.
        """
        root = Path(root)
        refuse_running(root)
        root.mkdir(parents=True, exist_ok=True)
        (root / BASE_PORT_FILE).unlink(missing_ok=True)
        if base_port is not None:
            (root / BASE_PORT_FILE).write_text(str(base_port))
        config = local_config(root, num_nodes, time_scale, backend, base_port, **node_defaults)
        config = with_local_reserves(config)
        config = secure(
            root,
            config,
            auth=auth,
            tls=tls or mtls,
            mtls=mtls,
            encrypt=encrypt,
            integrity=auth if integrity is None else integrity,
        )
        if etcd is not None:
            config = _on_etcd(root, config, etcd, down_out_s)
        return cls._spawn_all(root, config, base_port is not None, startup_timeout_s)

    @classmethod
    def _spawn_all(
        cls, root: Path, config: ClusterConfig, fixed_ports: bool, startup_timeout_s: float
    ) -> LocalCluster:
        """Write ``config`` as cluster.toml and start its nodes, until all serve; stop them
        on a failure. Free ports are only free when chosen: another process may bind one
        before a node does, so without ``fixed_ports`` a taken port means choosing again."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            save_cluster(config, root / "cluster.toml")
            cluster = cls(root, config)
            cluster.startup_timeout_s = startup_timeout_s
            try:
                for node in config.nodes:
                    cluster.procs[node.id] = spawn_node(root, node.id)
                cluster._save_pids()
                wait_healthy(root, config, cluster.procs, startup_timeout_s)
                return cluster
            except Unavailable as exc:
                taken = any(text in str(exc) for text in PORT_TAKEN)
                if fixed_ports or not taken or attempt == PORT_ATTEMPTS:
                    cluster.stop()
                    raise
                cluster.stop_nodes()  # etcd stays: it holds the map the next nodes must follow
                log.warning("a port was taken meanwhile; starting again on other ports")
                config = _on_new_ports(config)
            except BaseException:
                cluster.stop()
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def current_map(self) -> ClusterConfig:
        """The map in force: etcd's with membership on (kept in ``self.config`` too)."""
        if self.config.membership.endpoints:
            self.config = etcd_call(self.config, _get_map) or self.config
        return self.config

    def change_map(self, change: Callable[[ClusterConfig], ClusterConfig]) -> ClusterConfig:
        """Apply a map change in etcd (kvstore/map_changes.py) and keep cluster.toml a copy."""
        if not self.config.membership.endpoints:
            raise InvalidArgument(
                "this cluster has no etcd membership: its map is the static cluster.toml; "
                "start it with `kvstore cluster up --etcd` to join, drain or remove nodes"
            )
        self.config = etcd_call(self.config, lambda m: m.change_map(change))
        save_cluster(self.config, self.cluster_toml)
        return self.config

    def join_node(self, node_id: str | None = None) -> NodeConfig:
        """A new node on 127.0.0.1 (its own failure domain) joined to the map and started."""
        config = self.current_map()
        node_id = node_id or _next_node_id(config, self.root)
        fixed = next_ports(self.root, config, 2)
        grpc_port, metrics_port = fixed or free_ports(2)
        template = config.nodes[0]
        node = dataclasses.replace(
            template,
            id=node_id,
            address=f"127.0.0.1:{grpc_port}",
            metrics_port=metrics_port,
            failure_domain=node_id,
            data_dir=str(self.root.resolve() / node_id),
            state="in",
        )
        self.change_map(lambda c: join(c, node))
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.procs[node_id] = spawn_node(self.root, node_id, (), self.spawn_prefix(node_id))
            self._save_pids()
            try:
                wait_healthy(
                    self.root, self.config, {node_id: self.procs[node_id]}, self.startup_timeout_s
                )
                return self.config.node(node_id)
            except Unavailable as exc:
                self._stop_proc(self.procs[node_id])
                taken = any(text in str(exc) for text in PORT_TAKEN)
                if fixed or not taken or attempt == PORT_ATTEMPTS:
                    raise
                # Another process bound a chosen port first: the node moves to others.
                release_ports([grpc_port, metrics_port])
                grpc_port, metrics_port = free_ports(2)
                address = f"{node.host}:{grpc_port}"
                self.change_map(
                    partial(readdress, node_id=node_id, address=address, metrics_port=metrics_port)
                )
        raise AssertionError("unreachable: the last attempt returns or raises")

    def wait_for_map(
        self, done: Callable[[ClusterConfig], bool], timeout_s: float, what: str
    ) -> ClusterConfig:
        """Poll etcd's map until ``done`` holds (the keeper finishes moves); Unavailable
        naming ``what`` after ``timeout_s``."""
        deadline_s = time.monotonic() + timeout_s
        while not done(self.current_map()):
            if time.monotonic() > deadline_s:
                raise Unavailable(
                    f"{what} not done after {timeout_s:.0f} s (map epoch {self.config.epoch}, "
                    f"moving: {bool(self.config.moving_from)}); see `kvstore cluster status`"
                )
            time.sleep(0.2)
        save_cluster(self.config, self.cluster_toml)
        return self.config

    def drain_node(self, node_id: str, timeout_s: float = DRAIN_TIMEOUT_S) -> ClusterConfig:
        """Give the node's slots away, wait until its shards are on their new nodes
        (verified by the keeper) and it is "left"."""
        self.change_map(lambda c: drain(c, node_id))
        return self.wait_for_map(
            lambda c: c.node(node_id).state == "left", timeout_s, f"drain of {node_id}"
        )

    def remove_node(self, node_id: str) -> ClusterConfig:
        """Remove a left node from the map and stop its process if this cluster started it."""
        node = self.config.node(node_id)
        config = self.change_map(lambda c: remove(c, node_id))
        if node_id in self.procs:
            self._stop_proc(self.procs.pop(node_id))
            self._save_pids()
            release_ports(node_ports([node]))
        return config

    def _save_pids(self) -> None:
        """Record the running nodes; ones this object did not start (the CLI attached to a
        cluster that `up` started) keep their entries while they run."""
        others = {
            n: pid
            for n, pid in read_pids(self.root).items()
            if n not in self.procs and is_node_process(pid, n)
        }
        mine = {n: p.pid for n, p in self.procs.items() if p.poll() is None}
        write_pids(self.root, {**others, **mine})

    def kill_node(self, node_id: str) -> None:
        """SIGKILL one node (a crash: no clean shutdown) and reap it."""
        proc = self._proc(node_id)
        proc.kill()
        proc.wait()
        self._save_pids()

    def restart_node(self, node_id: str, extra_args: Sequence[str] = ()) -> None:
        """Stop the node if it runs, start it again with ``extra_args``, wait until it serves."""
        self._stop_proc(self._proc(node_id))
        self.procs[node_id] = spawn_node(self.root, node_id, extra_args, self.spawn_prefix(node_id))
        self._save_pids()
        wait_healthy(self.root, self.config, {node_id: self.procs[node_id]}, self.startup_timeout_s)

    def _proc(self, node_id: str) -> subprocess.Popen[bytes]:
        if node_id not in self.procs:
            self.config.node(node_id)  # raises with the known ids for a wrong one
        return self.procs[node_id]

    def is_running(self, node_id: str) -> bool:
        return self._proc(node_id).poll() is None

    def stop(self) -> None:
        """Stop every node (SIGTERM, wait, SIGKILL fallback), then the etcd this cluster
        started, if any. Safe to call twice."""
        self.stop_nodes()
        stop_etcd(self.root)
        release_ports(cluster_ports(self.config))

    def stop_nodes(self) -> None:
        """Stop every node this process started (SIGTERM, wait, SIGKILL fallback)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            self._stop_proc(proc)
        self._save_pids()

    @staticmethod
    def _stop_proc(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("node pid %d ignored SIGTERM; sending SIGKILL", proc.pid)
            proc.kill()
            proc.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def etcd_call(config: ClusterConfig, action: Callable[[EtcdMembership], Awaitable[Any]]) -> Any:
    """Run one etcd action for ``config``'s membership to completion (CLI and tests)."""

    async def call() -> Any:
        async with EtcdMembership(config.membership) as membership:
            return await action(membership)

    return asyncio.run(call())


async def _get_map(membership: EtcdMembership) -> ClusterConfig | None:
    got = await membership.get_map()
    return got[0] if got is not None else None


def _next_node_id(config: ClusterConfig, root: Path) -> str:
    """The first nNN neither in the map nor ever used in ``root`` (a removed node's data
    directory stays: a new node never starts on another's shards)."""
    taken = {n.id for n in config.nodes}
    return next(
        f"n{i:02d}"
        for i in range(len(taken) + 1000)
        if f"n{i:02d}" not in taken and not (root / f"n{i:02d}").exists()
    )
