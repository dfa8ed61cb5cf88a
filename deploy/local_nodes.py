"""Node processes on 127.0.0.1: free ports for them, starting one, waiting until it serves
(or saying why not, from its log), and its Health."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from deploy.local_secrets import local_client_cert
from deploy.processes import spawn_logged
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import channel_credentials, sync_channel

STARTUP_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 3
# What a node says when it cannot bind its port: gRPC's own error, or kvstore/node/main.py's.
PORT_TAKEN = ("Address already in use", "the port is taken")
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


def _reservations_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kvstore-ports-{os.getuid()}"


#: port -> the descriptor of its reservation file, locked by this process (see free_ports)
_reserved: dict[int, int] = {}


def _reserve(port: int) -> bool:
    """Take ``port``'s reservation: an exclusive flock on a file named after it, held until
    :func:`release_ports` or this process exits (the kernel drops it then, even on a crash).
    False if another live process holds it. Files stay: unlinking one another process has
    open would let two processes hold "the" lock at once."""
    if port in _reserved:
        return False
    directory = _reservations_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(directory / str(port), os.O_RDWR | os.O_CREAT, 0o600)  # not inherited
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _reserved[port] = fd
    return True


def release_ports(ports: Sequence[int]) -> None:
    """Give back reservations :func:`free_ports` took (ports never reserved are skipped)."""
    for port in ports:
        fd = _reserved.pop(port, None)
        if fd is not None:
            os.close(fd)


def free_ports(num_ports: int) -> list[int]:
    """Distinct ports free on 127.0.0.1 right now, chosen below the ephemeral range, and
    reserved for this process until :func:`release_ports` (or its exit).

    A port the OS picks for ``bind(0)`` comes from the ephemeral range, where any outgoing
    connection (a client dialing the nodes) may take it before the node binds it; ports
    below that range are only ever taken by an explicit bind. The reservation covers the
    time a port is free on purpose: a node killed and restarted on its own port (CI's
    test_a_restarted_node_takes_writes_as_soon_as_it_answers lost its port to another test
    worker's cluster that drew it meanwhile), or chosen and not yet bound. Every process
    that picks ports here (test workers, benches, `kvstore cluster up`) skips ports another
    live one holds.
    """
    high = _ephemeral_port_floor()
    low = max(1024, high - 12_000)
    rng = random.SystemRandom()
    chosen: list[int] = []
    try:
        while len(chosen) < num_ports:
            port = rng.randrange(low, high)
            if not _reserve(port):
                continue
            chosen.append(port)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:  # bound by a program that does not reserve: try another
                    chosen.pop()
                    release_ports([port])
        return chosen
    except BaseException:
        release_ports(chosen)
        raise


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


def new_ports(nodes: Sequence[NodeConfig]) -> tuple[NodeConfig, ...]:
    """``nodes`` on fresh free ports (gRPC and metrics), everything else kept."""
    ports = free_ports(2 * len(nodes))
    return tuple(
        dataclasses.replace(n, address=f"{n.host}:{ports[i]}", metrics_port=ports[len(nodes) + i])
        for i, n in enumerate(nodes)
    )


def _startup_failure(root: Path, node_id: str, what: str) -> str:
    tail = log_tail(root, node_id)
    return f"node {node_id} {what}; last lines of {root}/logs/{node_id}.log:\n{tail}"
