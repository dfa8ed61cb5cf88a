"""A cluster of storage-node processes on 127.0.0.1, for development, tests and benchmarks.

::

    kvstore cluster up --nodes 12 --dir DIR [--time-scale X] [--backend isal|zfec]
                       [--max-bytes 1GiB] [--no-fsync] [--base-port P] [--auth] [--tls]
                       [--etcd [HOST:PORT]] [--down-out-s 600]
    kvstore cluster status --dir DIR [--json]
    kvstore cluster add-tenant --dir DIR TENANT [--role service --tenants a,b] [--max-ttl ...]
    kvstore cluster join --dir DIR [--id ID] [--address H:P --failure-domain D --data-dir P]
    kvstore cluster drain --dir DIR NODE [--timeout-s 600] [--no-wait]
    kvstore cluster remove --dir DIR NODE
    kvstore cluster down --dir DIR

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
    admin.token        with --auth: the admin credential `up` wrote (0600), for status/purge
    node.token         with --auth: the credential nodes present to each other (0600)
    tls/               with --tls: the development CA and one certificate per node
    etcd/, etcd.pid    with --etcd (no endpoint): the local etcd's data and pid

On one machine the nodes share DIR, so they share one credentials file; on real hosts each
node has its own copy (the same file), and only the nodes can read it.

Each node is its own failure domain; groups come from kvstore.placement.make_groups (one group
per node, rotations of the node list). Programmatic use (tests, benchmarks)::

    with LocalCluster.start(tmp_path, num_nodes=12, time_scale=1.0, fsync=False) as cluster:
        cluster.kill_node("n03"); cluster.restart_node("n03", ["--inject-delay-ms", "50"])
"""

from __future__ import annotations

import argparse
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

from client.keyring import new_master_key
from deploy.cluster_status import print_status
from deploy.local_etcd import start_etcd, stop_etcd
from deploy.processes import spawn_logged
from kvstore.auth import Role, add_principal, read_token_file, set_tenant_caps, write_private
from kvstore.certs import init_ca, issue_files
from kvstore.cli.args import duration_arg, list_arg, size_arg
from kvstore.config import (
    ClientConfig,
    ClusterConfig,
    CodecConfig,
    EncryptionConfig,
    MembershipConfig,
    NodeConfig,
    TLSConfig,
    TTLConfig,
    load_cluster,
    save_cluster,
)
from kvstore.errors import ERRORS, InvalidArgument, Unavailable
from kvstore.map_changes import changed_slots, drain, join, readdress, remove
from kvstore.membership import EtcdMembership
from kvstore.placement import make_groups
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import channel_credentials, sync_channel
from ttl.units import parse_duration_s

log = logging.getLogger(__name__)

CREDENTIALS_FILE = "credentials.toml"
ADMIN_TOKEN_FILE = "admin.token"
NODE_TOKEN_FILE = "node.token"
TLS_DIR = "tls"
MASTER_KEY_FILE = "master.key"
KEYRING_FILE = "keyring.json"
MASTER_KEY_FILE = "master.key"
KEYRING_FILE = "keyring.json"
STARTUP_TIMEOUT_S = 60.0
LOCAL_ETCD = "local"  # `--etcd` without an endpoint: start one (deploy/local_etcd.py)
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
    address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None
) -> pb.HealthReply | None:
    """The node's Health reply, or None if it does not answer within ``timeout_s``."""
    with sync_channel(address, credentials, _HEALTH_OPTIONS) as channel:
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
            reply = health(config.node(node_id).address, 0.5, credentials)
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
) -> ClusterConfig:
    """``config`` with auth (credentials file, admin and node tokens), TLS (a dev CA, a
    certificate per node; ``mtls``: client certificates required) and encryption at rest for
    the ``encrypt`` tenants (a master key file and a keyring) set up under ``root``."""
    nodes = config.nodes
    encryption = config.encryption
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
            )
            for n in nodes
        )
    tls_config = config.tls
    if tls:
        tls_dir = root / TLS_DIR
        ca_file = init_ca(tls_dir)
        issued = {n.id: issue_files(tls_dir, n.id, [n.host, "localhost"]) for n in nodes}
        issue_files(tls_dir, "admin", [])
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
        """A new principal's token (``kvstore cluster add-tenant``); nodes see it within 1 s."""
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
        etcd: str | None = None,
        down_out_s: float = DEFAULT_DOWN_OUT_S,
        **node_defaults: Any,
    ) -> LocalCluster:
        """Write ``root/cluster.toml``, start every node concurrently, wait until all serve.

        ``node_defaults`` are NodeConfig fields for every node (``fsync=False``,
        ``max_bytes=...``). ``auth`` writes a credentials file with an admin and a node
        principal (``root/admin.token``); ``tls`` a CA and node certificates (``mtls``:
        clients must present one too); ``encrypt`` names tenants whose blocks clients seal
        (a master key and keyring under ``root``). ``etcd``: membership on etcd at that
        endpoint, or ``"local"`` to start one (deploy/local_etcd.py), with ``down_out_s``. On
        a startup failure the started nodes (and a started etcd) are stopped.
        """
        root = Path(root)
        if any(is_node_process(pid, n) for n, pid in read_pids(root).items()):
            raise InvalidArgument(
                f"a cluster is already running in {root}; run `kvstore cluster down --dir {root}`"
            )
        root.mkdir(parents=True, exist_ok=True)
        config = local_config(root, num_nodes, time_scale, backend, base_port, **node_defaults)
        config = secure(root, config, auth=auth, tls=tls or mtls, mtls=mtls, encrypt=encrypt)
        if etcd is not None:
            endpoint = start_etcd(root, *free_ports(2)) if etcd == LOCAL_ETCD else etcd
            membership = MembershipConfig(etcd=endpoint, down_out_s=down_out_s)
            config = dataclasses.replace(config, membership=membership)
            existing = etcd_call(config, _get_map)
            if existing is not None:
                stop_etcd(root)
                raise InvalidArgument(
                    f"etcd {endpoint} already holds a cluster map under {membership.prefix} "
                    f"(epoch {existing.epoch}, {len(existing.nodes)} nodes): its nodes would "
                    "follow that map, not this one; use an etcd of its own (--etcd alone "
                    "starts one) or remove the old map"
                )
        for attempt in range(1, PORT_ATTEMPTS + 1):
            save_cluster(config, root / "cluster.toml")
            cluster = cls(root, config)
            try:
                for node in config.nodes:
                    cluster.procs[node.id] = spawn_node(root, node.id)
                cluster._save_pids()
                wait_healthy(root, config, cluster.procs, startup_timeout_s)
                return cluster
            except Unavailable as exc:
                cluster.stop()
                # Free ports are only free when chosen: another process may bind one before a
                # node does. With ports of our own choosing, choose again.
                taken = any(text in str(exc) for text in _PORT_TAKEN)
                if base_port is not None or not taken or attempt == PORT_ATTEMPTS:
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
        grpc_port, metrics_port = free_ports(2)
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
                wait_healthy(self.root, self.config, {node_id: self.procs[node_id]})
                return self.config.node(node_id)
            except Unavailable as exc:
                self._stop_proc(self.procs[node_id])
                if not any(text in str(exc) for text in _PORT_TAKEN) or attempt == PORT_ATTEMPTS:
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
        wait_healthy(self.root, self.config, {node_id: self.procs[node_id]})

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


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's directory")


def configure_up(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster up``."""
    _add_dir(parser)
    parser.add_argument("--nodes", type=int, default=12, help="number of nodes (at least k+m)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="virtual seconds per real second"
    )
    parser.add_argument(
        "--backend", choices=["isal", "zfec"], default="isal", help="erasure code backend"
    )
    parser.add_argument(
        "--max-bytes",
        type=size_arg,
        default=0,
        help="per-node limit for shard data, e.g. 1GiB; 0 = the disk's free space",
    )
    parser.add_argument("--no-fsync", action="store_true", help="skip fsync (tests only)")
    parser.add_argument(
        "--base-port", type=int, default=None, help="first port to use (default: free ports)"
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="require credentials: write DIR/credentials.toml and an admin token (DIR/admin.token)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="TLS on every channel: a dev CA and node certificates"
    )
    parser.add_argument(
        "--mtls", action="store_true", help="like --tls, and clients must present certificates"
    )
    parser.add_argument(
        "--encrypt",
        type=list_arg(str),
        default=[],
        help="tenants whose blocks clients seal (AES-GCM; DIR/master.key, DIR/keyring.json)",
    )

    parser.add_argument(
        "--etcd",
        nargs="?",
        const=LOCAL_ETCD,
        default=None,
        metavar="ENDPOINT",
        help="membership on etcd at HOST:PORT; without ENDPOINT start a local etcd from the "
        "etcd binary (DIR/etcd); absent: the static cluster.toml",
    )
    parser.add_argument(
        "--down-out-s",
        type=duration_arg,
        default=DEFAULT_DOWN_OUT_S,
        help="with --etcd: a node down this long (cluster clock) is marked out and replaced",
    )


def run_up(args: argparse.Namespace) -> int:
    return _report_errors(_up, args)


def configure_add_tenant(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster add-tenant``."""
    _add_dir(parser)
    parser.add_argument("tenant", help="the tenant (or service) name; its token is printed")
    parser.add_argument(
        "--role",
        choices=[Role.TENANT.value, Role.SERVICE.value, Role.ADMIN.value, Role.NODE.value],
        default=Role.TENANT.value,
        help="tenant: its own blocks; service: acts for --tenants; admin: stats and purge",
    )
    parser.add_argument(
        "--tenants",
        type=list_arg(str),
        default=[],
        help="for --role service: the tenants it may act for, comma-separated ('*' = any)",
    )
    parser.add_argument(
        "--max-ttl",
        type=list_arg(_class_cap),
        default=[],
        help="retention caps for this tenant, e.g. chat=1d,agent=12h (nodes enforce them)",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        default=None,
        help="the credentials file to change (default: DIR/credentials.toml)",
    )
    parser.add_argument(
        "--cert-identity", default="", help="common name of its mTLS client certificate"
    )


def _class_cap(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"a cap is CLASS=DURATION like chat=1d, got {text!r}")
    return name.strip(), parse_duration_s(value.strip())


def run_add_tenant(args: argparse.Namespace) -> int:
    return _report_errors(_add_tenant, args)


def _add_tenant(args: argparse.Namespace) -> int:
    path = args.credentials or args.dir / CREDENTIALS_FILE
    role = Role(args.role)
    token = add_principal(
        path, args.tenant, role, frozenset(args.tenants), cert_identity=args.cert_identity
    )
    if args.max_ttl:
        set_tenant_caps(path, args.tenant, dict(args.max_ttl))
    print(token)
    return 0


def configure_status(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster status``."""
    _add_dir(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run_status(args: argparse.Namespace) -> int:
    return _report_errors(_status, args)


def _status(args: argparse.Namespace) -> int:
    config = load_cluster(args.dir / "cluster.toml")
    return print_status(
        args.dir,
        read_pids(args.dir),
        as_json=args.json,
        token=local_admin_token(args.dir),
        client_cert=local_client_cert(args.dir, config),
    )


def configure_join(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster join``."""
    _add_dir(parser)
    parser.add_argument("--id", default=None, help="the new node's id (default: the next nNN)")
    parser.add_argument(
        "--address",
        default=None,
        help="host:port of a node started elsewhere (default: start one here on 127.0.0.1)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="with --address: its metrics port"
    )
    parser.add_argument("--failure-domain", default=None, help="with --address: its host or rack")
    parser.add_argument("--data-dir", default=None, help="with --address: its data directory")


def run_join(args: argparse.Namespace) -> int:
    return _report_errors(_join, args)


def _join(args: argparse.Namespace) -> int:
    cluster = _attached(args.dir)
    before = cluster.current_map()
    if args.address is None:
        node = cluster.join_node(args.id)
        print(f"node {node.id} joined on {node.address} (pid {cluster.procs[node.id].pid})")
    else:
        if not (args.id and args.failure_domain and args.data_dir):
            raise InvalidArgument("--address needs --id, --failure-domain and --data-dir too")
        node = dataclasses.replace(
            before.nodes[0],
            id=args.id,
            address=args.address,
            metrics_port=args.metrics_port,
            failure_domain=args.failure_domain,
            data_dir=args.data_dir,
            state="in",
        )
        cluster.change_map(lambda c: join(c, node))
        print(
            f"node {node.id} joined the map; start it on its host: "
            f"`kvstore node --config cluster.toml --id {node.id}`"
        )
    _print_move(before, cluster.config)
    return 0


def _print_move(before: ClusterConfig, after: ClusterConfig) -> None:
    slots = changed_slots(before.groups, after.groups)
    print(
        f"map epoch {before.epoch} -> {after.epoch}: {len(slots)} of "
        f"{sum(map(len, after.groups))} group slots move; repair fills them, and the keeper "
        "finishes the move once verified (`kvstore cluster status`)"
    )


def configure_drain(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster drain``."""
    _add_dir(parser)
    parser.add_argument("node", help="id of the node to drain")
    parser.add_argument(
        "--timeout-s", type=duration_arg, default=DRAIN_TIMEOUT_S, help="how long to wait"
    )
    parser.add_argument("--no-wait", action="store_true", help="start the drain and return")


def run_drain(args: argparse.Namespace) -> int:
    return _report_errors(_drain, args)


def _drain(args: argparse.Namespace) -> int:
    cluster = _attached(args.dir)
    before = cluster.current_map()
    if args.no_wait:
        cluster.change_map(lambda c: drain(c, args.node))
        _print_move(before, cluster.config)
        return 0
    started_s = time.monotonic()
    after = cluster.drain_node(args.node, args.timeout_s)
    print(
        f"node {args.node} drained in {time.monotonic() - started_s:.1f} s: its shards are on "
        f"their new nodes (verified), map epoch {after.epoch}; remove it with "
        f"`kvstore cluster remove --dir {args.dir} {args.node}`"
    )
    return 0


def configure_remove(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster remove``."""
    _add_dir(parser)
    parser.add_argument("node", help="id of a drained ('left') node")


def run_remove(args: argparse.Namespace) -> int:
    return _report_errors(_remove, args)


def _remove(args: argparse.Namespace) -> int:
    cluster = _attached(args.dir)
    pid = read_pids(args.dir).get(args.node)
    after = cluster.remove_node(args.node)
    stopped = ""
    if pid is not None and is_node_process(pid, args.node):
        stop_pids({args.node: pid})
        stopped = f"; stopped its process (pid {pid})"
        write_pids(args.dir, {n: p for n, p in read_pids(args.dir).items() if n != args.node})
    print(f"node {args.node} removed from the map (epoch {after.epoch}){stopped}")
    return 0


def _attached(root: Path) -> LocalCluster:
    """The cluster of ``root`` as the CLI sees it (its processes are not ours)."""
    return LocalCluster(root, load_cluster(root / "cluster.toml"))


def configure_down(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster down``."""
    _add_dir(parser)


def run_down(args: argparse.Namespace) -> int:
    return _report_errors(_down, args)


def _report_errors(action: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one cluster action; errors are printed, not raised."""
    try:
        return action(args)
    except (*ERRORS, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _down(args: argparse.Namespace) -> int:
    node_to_pid = read_pids(args.dir)
    running = {n: pid for n, pid in node_to_pid.items() if is_node_process(pid, n)}
    stop_pids(node_to_pid)
    write_pids(args.dir, {})
    if running:
        print(
            f"stopped {len(running)} node{'s' if len(running) != 1 else ''}: "
            + ", ".join(f"{n} (pid {p})" for n, p in sorted(running.items()))
        )
    else:
        print(f"no node of {args.dir} was running")
    etcd = stop_etcd(args.dir)
    if etcd is not None:
        print(f"stopped etcd (pid {etcd}); its data stays in {args.dir / 'etcd'}")
    return 0


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


def _up(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {"max_bytes": args.max_bytes}
    if args.no_fsync:
        overrides["fsync"] = False
    cluster = LocalCluster.start(
        args.dir,
        args.nodes,
        args.time_scale,
        backend=args.backend,
        base_port=args.base_port,
        auth=args.auth,
        tls=args.tls,
        mtls=args.mtls,
        encrypt=args.encrypt,
        etcd=args.etcd,
        down_out_s=args.down_out_s,
        **overrides,
    )
    print(f"{len(cluster.procs)} nodes serving; cluster map: {cluster.cluster_toml}")
    if cluster.config.membership.endpoints:
        print(
            f"membership on etcd {cluster.config.membership.etcd} (map epoch "
            f"{cluster.config.epoch}, down->out after {args.down_out_s:g} s)"
        )
    if args.auth:
        print(
            f"auth on: admin token in {args.dir / ADMIN_TOKEN_FILE}; add tenants with "
            f"`kvstore cluster add-tenant --dir {args.dir} TENANT`"
        )
    return 0
