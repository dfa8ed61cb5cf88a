"""A cluster of storage-node processes on 127.0.0.1, for development, tests and benchmarks.

::

    kvstore cluster up --nodes 12 --dir DIR [--time-scale X] [--backend isal|zfec]
                       [--max-bytes 1GiB] [--no-fsync] [--base-port P]
    kvstore cluster status --dir DIR [--json]
    kvstore cluster down --dir DIR

Layout of DIR::

    cluster.toml     the cluster map every node and client reads (written by `up`)
    pids.json        node id -> pid of the running node process
    logs/<id>.log    each node's stdout and stderr (appended across restarts)
    <id>/            each node's data directory

Each node is its own failure domain; groups come from kvstore.placement.make_groups (one group
per node, rotations of the node list). Programmatic use (tests, benchmarks)::

    with LocalCluster.start(tmp_path, num_nodes=12, time_scale=1.0, fsync=False) as cluster:
        cluster.kill_node("n03"); cluster.restart_node("n03", ["--inject-delay-ms", "50"])
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from deploy.cluster_status import print_status
from kvstore.cli import size_arg
from kvstore.config import (
    ClientConfig,
    ClusterConfig,
    CodecConfig,
    NodeConfig,
    TTLConfig,
    save_cluster,
)
from kvstore.errors import ERRORS, InvalidArgument, Unavailable
from kvstore.placement import make_groups
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
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


def spawn_node(root: Path, node_id: str, extra_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start one node in its own session, logging to ``root/logs/<id>.log``."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kvstore.cli", "node", "--config", str(root / "cluster.toml")]
    command += ["--id", node_id, *extra_args]
    with open(logs / f"{node_id}.log", "ab") as log_file:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_tail(root: Path, node_id: str, num_lines: int = 15) -> str:
    path = root / "logs" / f"{node_id}.log"
    if not path.exists():
        return "(no log yet)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def health(address: str, timeout_s: float) -> pb.HealthReply | None:
    """The node's Health reply, or None if it does not answer within ``timeout_s``."""
    with grpc.insecure_channel(address, options=_HEALTH_OPTIONS) as channel:
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
    while waiting:
        for node_id, proc in list(waiting.items()):
            if proc.poll() is not None:
                raise Unavailable(_startup_failure(root, node_id, f"exited with {proc.returncode}"))
            reply = health(config.node(node_id).address, timeout_s=0.5)
            if reply is not None and reply.serving:
                del waiting[node_id]
        if waiting and time.monotonic() > deadline_s:
            node_id = sorted(waiting)[0]
            raise Unavailable(_startup_failure(root, node_id, f"not healthy after {timeout_s} s"))
        if waiting:
            time.sleep(_POLL_S)


def _startup_failure(root: Path, node_id: str, what: str) -> str:
    tail = log_tail(root, node_id)
    return f"node {node_id} {what}; last lines of {root}/logs/{node_id}.log:\n{tail}"


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

    def __init__(self, root: Path, config: ClusterConfig) -> None:
        self.root = root
        self.config = config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def cluster_toml(self) -> Path:
        return self.root / "cluster.toml"

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
        **node_defaults: Any,
    ) -> LocalCluster:
        """Write ``root/cluster.toml``, start every node concurrently, wait until all serve.

        ``node_defaults`` are NodeConfig fields for every node (``fsync=False``,
        ``max_bytes=...``). On a startup failure the started nodes are stopped again.
        """
        root = Path(root)
        if any(is_node_process(pid, n) for n, pid in read_pids(root).items()):
            raise InvalidArgument(
                f"a cluster is already running in {root}; run `kvstore cluster down --dir {root}`"
            )
        root.mkdir(parents=True, exist_ok=True)
        config = local_config(root, num_nodes, time_scale, backend, base_port, **node_defaults)
        save_cluster(config, root / "cluster.toml")
        cluster = cls(root, config)
        try:
            for node in config.nodes:
                cluster.procs[node.id] = spawn_node(root, node.id)
            cluster._save_pids()
            wait_healthy(root, config, cluster.procs, startup_timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _save_pids(self) -> None:
        write_pids(self.root, {n: p.pid for n, p in self.procs.items() if p.poll() is None})

    def kill_node(self, node_id: str) -> None:
        """SIGKILL one node (a crash: no clean shutdown) and reap it."""
        proc = self._proc(node_id)
        proc.kill()
        proc.wait()
        self._save_pids()

    def restart_node(self, node_id: str, extra_args: Sequence[str] = ()) -> None:
        """Stop the node if it runs, start it again with ``extra_args``, wait until it serves."""
        self._stop_proc(self._proc(node_id))
        self.procs[node_id] = spawn_node(self.root, node_id, extra_args)
        self._save_pids()
        wait_healthy(self.root, self.config, {node_id: self.procs[node_id]})

    def _proc(self, node_id: str) -> subprocess.Popen[bytes]:
        self.config.node(node_id)  # raises with the known ids for a wrong one
        return self.procs[node_id]

    def is_running(self, node_id: str) -> bool:
        return self._proc(node_id).poll() is None

    def stop(self) -> None:
        """Stop every node: SIGTERM, wait, SIGKILL fallback. Safe to call twice."""
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


def run_up(args: argparse.Namespace) -> int:
    return _report_errors(_up, args)


def configure_status(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster status``."""
    _add_dir(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run_status(args: argparse.Namespace) -> int:
    return _report_errors(lambda a: print_status(a.dir, read_pids(a.dir), as_json=a.json), args)


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
            f"stopped {len(running)} nodes: "
            + ", ".join(f"{n} (pid {p})" for n, p in sorted(running.items()))
        )
    else:
        print(f"no node of {args.dir} was running")
    return 0


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
        **overrides,
    )
    print(f"{len(cluster.procs)} nodes serving; cluster map: {cluster.cluster_toml}")
    return 0
