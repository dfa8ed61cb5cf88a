"""A cluster of storage-node processes on 127.0.0.1, for development, tests and benchmarks.

This is the library: :class:`LocalCluster` (start, stop, kill and restart nodes, join, drain
and remove them), ``cluster.toml`` written by :func:`local_config` and :func:`secure`, and the
pid bookkeeping of a cluster directory. The ``kvstore cluster`` commands (up, status, down,
join, drain, remove, add-tenant) are deploy/cluster_cli.py.

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
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from client.integrity import ensure_key
from client.keyring import new_master_key
from deploy.local_etcd import issue_etcd_certs, membership_tls, start_etcd, stop_etcd
from deploy.processes import spawn_logged
from kvstore.auth import Role, add_principal, read_token_file, write_private
from kvstore.certs import init_ca, issue_files
from kvstore.config import (
    ClientConfig,
    ClusterConfig,
    CodecConfig,
    EncryptionConfig,
    IntegrityConfig,
    MembershipConfig,
    NodeConfig,
    TLSConfig,
    TTLConfig,
    save_cluster,
)
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.map_changes import drain, join, readdress, remove
from kvstore.membership import EtcdMembership
from kvstore.placement import make_groups
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import channel_credentials, sync_channel

log = logging.getLogger(__name__)

CREDENTIALS_FILE = "credentials.toml"
ADMIN_TOKEN_FILE = "admin.token"
NODE_TOKEN_FILE = "node.token"
TLS_DIR = "tls"
MASTER_KEY_FILE = "master.key"
INTEGRITY_KEY_FILE = "integrity.json"
KEYRING_FILE = "keyring.json"
STARTUP_TIMEOUT_S = 60.0
LOCAL_ETCD = "local"  # `--etcd` without an endpoint: start one (deploy/local_etcd.py)
BASE_PORT_FILE = "base_port"
DEFAULT_DOWN_OUT_S = 600.0  # Ceph's mon_osd_down_out_interval
DRAIN_TIMEOUT_S = 600.0
PORT_ATTEMPTS = 3
# What a node says when it cannot bind its port: gRPC's own error, or kvstore/node/main.py's.
_PORT_TAKEN = ("Address already in use", "the port is taken")
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.05
_HEALTH_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
)


def _ephemeral_port_floor() -> int:
    """Lowest port the kernel hands out to outgoing connections (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(num_ports: int) -> list[int]:
    """Distinct ports free on 127.0.0.1 right now, chosen below the ephemeral range.

    A port the OS picks for ``bind(0)`` comes from the ephemeral range, where any outgoing
    connection (a client dialing the nodes) may take it before the node binds it; ports
    below that range are only ever taken by an explicit bind.
    """
    high = _ephemeral_port_floor()
    low = max(1024, high - 12_000)
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < num_ports:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", rng.randrange(low, high)))
            except OSError:  # taken (or already ours): try another
                sock.close()
                continue
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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


def spawn_node(
    root: Path, node_id: str, extra_args: Sequence[str] = (), prefix: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """Start one node in its own session, logging to ``root/logs/<id>.log``; ``prefix`` runs
    it through another command (``ip netns exec NS``: a host of the namespace test)."""
    command = [*prefix, sys.executable, "-m", "kvstore.cli", "node"]
    command += ["--config", str(root / "cluster.toml")]
    command += ["--id", node_id, *extra_args]
    return spawn_logged(command, root / "logs" / f"{node_id}.log")


def log_tail(root: Path, node_id: str, num_lines: int = 15) -> str:
    path = root / "logs" / f"{node_id}.log"
    if not path.exists():
        return "(no log yet)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def health(
    address: str,
    timeout_s: float,
    credentials: grpc.ChannelCredentials | None = None,
    node_id: str | None = None,
) -> pb.HealthReply | None:
    """The node's Health reply, or None if it does not answer within ``timeout_s`` (with TLS
    and ``node_id``: or if the server there is not that node)."""
    with sync_channel(address, credentials, _HEALTH_OPTIONS, node_id=node_id) as channel:
        try:
            return ShardStoreStub(channel).Health(pb.HealthRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None


def wait_healthy(
    root: Path,
    config: ClusterConfig,
    procs: dict[str, subprocess.Popen[bytes]],
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> None:
    """Poll Health on every node in ``procs`` until all serve; raise Unavailable otherwise."""
    deadline_s = time.monotonic() + timeout_s
    waiting = dict(procs)
    credentials = channel_credentials(config, *local_client_cert(root, config))
    while waiting:
        for node_id, proc in list(waiting.items()):
            if proc.poll() is not None:
                raise Unavailable(_startup_failure(root, node_id, f"exited with {proc.returncode}"))
            reply = health(config.node(node_id).address, 0.5, credentials, node_id)
            if reply is not None and reply.serving:
                del waiting[node_id]
        if waiting and time.monotonic() > deadline_s:
            node_id = sorted(waiting)[0]
            raise Unavailable(_startup_failure(root, node_id, f"not healthy after {timeout_s} s"))
        if waiting:
            time.sleep(_POLL_S)


def _new_ports(nodes: Sequence[NodeConfig]) -> tuple[NodeConfig, ...]:
    """``nodes`` on fresh free ports (gRPC and metrics), everything else kept."""
    ports = free_ports(2 * len(nodes))
    return tuple(
        dataclasses.replace(n, address=f"{n.host}:{ports[i]}", metrics_port=ports[len(nodes) + i])
        for i, n in enumerate(nodes)
    )


def _startup_failure(root: Path, node_id: str, what: str) -> str:
    tail = log_tail(root, node_id)
    return f"node {node_id} {what}; last lines of {root}/logs/{node_id}.log:\n{tail}"


def secure(
    root: Path,
    config: ClusterConfig,
    *,
    auth: bool,
    tls: bool,
    mtls: bool,
    encrypt: Sequence[str] = (),
    integrity: bool = False,
) -> ClusterConfig:
    """``config`` with auth (credentials file, admin and node tokens), TLS (a dev CA, a
    certificate per node; ``mtls``: client certificates required), encryption at rest for
    the ``encrypt`` tenants (a master key file and a keyring) and end-to-end ``integrity``
    (a key file for the tenants' integrity keys) set up under ``root``."""
    nodes = config.nodes
    encryption = config.encryption
    if integrity:
        key_file = root / INTEGRITY_KEY_FILE
        key_file.unlink(missing_ok=True)
        config = dataclasses.replace(config, integrity=IntegrityConfig(str(key_file.resolve())))
    if encrypt:
        master = new_master_key(root / MASTER_KEY_FILE)
        encryption = EncryptionConfig(
            tuple(encrypt), str((root / KEYRING_FILE).resolve()), str(master.resolve())
        )
    if auth:
        credentials = root / CREDENTIALS_FILE
        credentials.unlink(missing_ok=True)
        write_private(root / ADMIN_TOKEN_FILE, add_principal(credentials, "admin", Role.ADMIN))
        node_token = add_principal(credentials, "nodes", Role.NODE)
        write_private(root / NODE_TOKEN_FILE, node_token)
        nodes = tuple(
            dataclasses.replace(
                n,
                credentials_file=str(credentials.resolve()),
                peer_token_file=str((root / NODE_TOKEN_FILE).resolve()),
                metrics_auth=True,  # /metrics names tenants: only an admin or node reads it
            )
            for n in nodes
        )
    tls_config = config.tls
    if tls:
        tls_dir = root / TLS_DIR
        ca_file = init_ca(tls_dir)
        issued = {n.id: issue_files(tls_dir, n.id, [n.host], node=True) for n in nodes}
        issue_files(tls_dir, "admin")
        nodes = tuple(
            dataclasses.replace(
                n,
                tls_cert_file=str(issued[n.id][0].resolve()),
                tls_key_file=str(issued[n.id][1].resolve()),
            )
            for n in nodes
        )
        tls_config = TLSConfig("on", str(ca_file.resolve()), "require" if mtls else "none")
    return dataclasses.replace(config, nodes=nodes, tls=tls_config, encryption=encryption)


def provision_integrity(
    key_file: str, name: str, role: Role, tenants: Sequence[str] = ()
) -> list[str]:
    """With an integrity key file (``[integrity] key_file``; "" = integrity off), make the
    integrity key of each tenant principal ``name`` acts for (itself, or a service's listed
    tenants; client/integrity.py); the tenants whose key it made."""
    acts_for = [name] if role is Role.TENANT else [t for t in tenants if t != "*"]
    if not key_file or role not in (Role.TENANT, Role.SERVICE):
        return []
    return [t for t in acts_for if ensure_key(key_file, t)]


def local_admin_token(root: Path) -> str | None:
    """The admin token `cluster up --auth` wrote, or None (no auth, or not a local cluster)."""
    path = root / ADMIN_TOKEN_FILE
    return read_token_file(path) if path.exists() else None


def local_client_cert(root: Path, config: ClusterConfig) -> tuple[str | None, str | None]:
    """The admin client certificate of a local mutual-TLS cluster, else (None, None)."""
    cert, key = root / TLS_DIR / "admin.pem", root / TLS_DIR / "admin.key"
    if config.tls.client_certs == "require" and cert.exists():
        return str(cert), str(key)
    return None, None


def next_ports(root: Path, config: ClusterConfig, count: int) -> list[int] | None:
    """With ``--base-port`` (``root/base_port``): the ``count`` ports after every port the
    cluster uses (its nodes' and its local etcd's); None: the cluster takes free ports."""
    path = root / BASE_PORT_FILE
    if not path.exists():
        return None
    used = [int(path.read_text()) - 1]
    used += [int(n.address.rpartition(":")[2]) for n in config.nodes]
    used += [n.metrics_port for n in config.nodes]
    etcd_ports = [e.rpartition(":")[2] for e in config.membership.endpoints]
    used += [int(port) + 1 for port in etcd_ports if port.isdigit()]  # client, then peer
    first = max(used) + 1
    return list(range(first, first + count))


def read_pids(root: Path) -> dict[str, int]:
    path = root / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_pids(root: Path, node_to_pid: dict[str, int]) -> None:
    tmp = root / "pids.json.tmp"
    tmp.write_text(json.dumps(node_to_pid, indent=1, sort_keys=True))
    tmp.replace(root / "pids.json")


def is_node_process(pid: int, node_id: str) -> bool:
    """Whether ``pid`` is alive and is the kvstore node ``node_id`` (guards against pid reuse)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"node" in argv and node_id.encode() in argv and b"kvstore.cli" in argv


def stop_pids(node_to_pid: dict[str, int], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every node process, wait up to ``timeout_s``, then SIGKILL what is left."""
    alive = {n: pid for n, pid in node_to_pid.items() if is_node_process(pid, n)}
    _signal_all(alive.values(), signal.SIGTERM)
    deadline_s = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline_s:
        time.sleep(_POLL_S)
        alive = {n: pid for n, pid in alive.items() if is_node_process(pid, n) and not _reap(pid)}
    if alive:
        log.warning("nodes %s ignored SIGTERM for %s s; sending SIGKILL", sorted(alive), timeout_s)
        _signal_all(alive.values(), signal.SIGKILL)
        for pid in alive.values():
            _reap(pid)


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(pid: int) -> bool:
    """Collect ``pid`` if it is our exited child; True if it is gone (or was never ours)."""
    try:
        done_pid, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done_pid == pid


def _refuse_running(root: Path) -> None:
    """InvalidArgument when nodes of a cluster in ``root`` still run (one ``up`` per DIR)."""
    if any(is_node_process(pid, n) for n, pid in read_pids(root).items()):
        raise InvalidArgument(
            f"a cluster is already running in {root}; run `kvstore cluster down --dir {root}`"
        )


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
        _refuse_running(root)
        root.mkdir(parents=True, exist_ok=True)
        (root / BASE_PORT_FILE).unlink(missing_ok=True)
        if base_port is not None:
            (root / BASE_PORT_FILE).write_text(str(base_port))
        config = local_config(root, num_nodes, time_scale, backend, base_port, **node_defaults)
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
                cluster.stop()
                taken = any(text in str(exc) for text in _PORT_TAKEN)
                if fixed_ports or not taken or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("a port was taken meanwhile; starting again on other ports")
                config = dataclasses.replace(config, nodes=_new_ports(config.nodes))
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
                taken = any(text in str(exc) for text in _PORT_TAKEN)
                if fixed or not taken or attempt == PORT_ATTEMPTS:
                    raise
                # Another process bound a chosen port first: the node moves to others.
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
        config = self.change_map(lambda c: remove(c, node_id))
        if node_id in self.procs:
            self._stop_proc(self.procs.pop(node_id))
            self._save_pids()
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
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            self._stop_proc(proc)
        self._save_pids()
        stop_etcd(self.root)

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
