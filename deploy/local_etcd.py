"""A single-member etcd on 127.0.0.1 for a local cluster (``kvstore cluster up --etcd``).

Runs the ``etcd`` binary (Debian's ``etcd-server`` package; ``make system-packages`` installs
it where it can) with its data in ``DIR/etcd`` and its log in ``DIR/logs/etcd.log``; its pid is
kept in ``DIR/etcd.pid`` so ``cluster down`` stops it. Real deployments point ``--etcd`` (or
``[membership] etcd``) at their own etcd cluster instead (deploy/systemd, deploy/k8s).

With TLS (:func:`issue_etcd_certs`, what ``cluster up --tls --etcd`` does) etcd serves clients
and its peer port over TLS with a certificate of a CA of its own (``DIR/tls/etcd/``), requires
client certificates of that CA (``--client-cert-auth``), and runs with etcd's RBAC on
(:func:`enable_etcd_rbac`): the certificate's common name is the user, ``kvstore-node`` may
read and write the cluster's keys (nodes, the ``kvstore cluster`` commands), ``kvstore-reader``
only read them (clients following the map), ``root`` administers etcd. A tenant's or a node's
kvstore certificate (another CA) cannot even connect.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from aetcd import rpc

from deploy.processes import spawn_logged
from kvstore.certs import init_ca, issue_files
from kvstore.errors import Unavailable

ETCD_PID_FILE = "etcd.pid"
NODE_USER, READER_USER, ROOT_USER = "kvstore-node", "kvstore-reader", "root"
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.05


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary, or None when it is not installed."""
    return shutil.which("etcd")


@dataclass(frozen=True)
class EtcdTLS:
    """The certificates of a local etcd with TLS (see the module docstring)."""

    ca_file: Path
    server_cert_file: Path  # etcd's, also its peer certificate
    server_key_file: Path
    node_cert_file: Path  # CN kvstore-node: read and write the cluster's keys
    node_key_file: Path
    reader_cert_file: Path  # CN kvstore-reader: read them
    reader_key_file: Path
    root_cert_file: Path  # CN root: etcd's administrator (sets RBAC up)
    root_key_file: Path


def issue_etcd_certs(directory: Path, host: str = "127.0.0.1") -> EtcdTLS:
    """A CA of etcd's own in ``directory``, etcd's certificate for ``host`` and the client
    certificates of its three users."""
    ca_file = init_ca(directory)
    server = issue_files(directory, "etcd-server", [host, "localhost"], server=True)
    users = [issue_files(directory, user) for user in (NODE_USER, READER_USER, ROOT_USER)]
    return EtcdTLS(ca_file, *server, *users[0], *users[1], *users[2])


def membership_tls(tls: EtcdTLS) -> dict[str, str]:
    """The ``[membership]`` fields (kvstore/config.py) that make clients use ``tls``."""
    return {
        "ca_file": str(tls.ca_file.resolve()),
        "cert_file": str(tls.node_cert_file.resolve()),
        "key_file": str(tls.node_key_file.resolve()),
        "reader_cert_file": str(tls.reader_cert_file.resolve()),
        "reader_key_file": str(tls.reader_key_file.resolve()),
    }


def start_etcd(
    root: Path,
    client_port: int,
    peer_port: int,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    tls: EtcdTLS | None = None,
    key_prefix: str = "/kvstore",
) -> str:
    """Start etcd for ``root`` in its own session; return its client endpoint once it answers.
    ``prefix`` runs it through another command (``ip netns exec NS``). With ``tls``: TLS,
    client certificates and RBAC over the keys under ``key_prefix`` (module docstring).

    Raises Unavailable (with the log's tail) when the binary is missing or etcd does not come
    up within STARTUP_TIMEOUT_S."""
    binary = etcd_binary()
    if binary is None:
        raise Unavailable(
            "no etcd binary: install Debian's etcd-server (`make system-packages` as root, or "
            "apt-get install etcd-server), or pass --etcd HOST:PORT of a running etcd"
        )
    scheme = "https" if tls else "http"
    client_url, peer_url = f"{scheme}://{host}:{client_port}", f"{scheme}://{host}:{peer_port}"
    command = [
        *prefix,
        binary,
        "--name", "kvstore",
        "--data-dir", str(root / "etcd"),
        "--listen-client-urls", client_url,
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"kvstore={peer_url}",
        *(_tls_flags(tls) if tls else ()),
    ]  # fmt: skip
    log_path = root / "logs" / "etcd.log"
    proc = spawn_logged(command, log_path)
    (root / ETCD_PID_FILE).write_text(str(proc.pid))
    deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
    while not _answers(host, client_port):
        if proc.poll() is not None or time.monotonic() > deadline_s:
            stop_etcd(root)
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-10:])
            raise Unavailable(f"etcd did not start on {client_url}; {log_path}:\n{tail}")
        time.sleep(_POLL_S)
    endpoint = f"{host}:{client_port}"
    if tls is not None:
        try:
            enable_etcd_rbac(endpoint, tls, key_prefix)
        except BaseException:
            stop_etcd(root)
            raise
    return endpoint


def _tls_flags(tls: EtcdTLS) -> list[str]:
    server = ["--cert-file", str(tls.server_cert_file), "--key-file", str(tls.server_key_file)]
    peer = ["--peer-cert-file", str(tls.server_cert_file)]
    peer += ["--peer-key-file", str(tls.server_key_file)]
    trust = ["--client-cert-auth", "--trusted-ca-file", str(tls.ca_file)]
    trust += ["--peer-client-cert-auth", "--peer-trusted-ca-file", str(tls.ca_file)]
    return server + peer + trust


def enable_etcd_rbac(endpoint: str, tls: EtcdTLS, key_prefix: str) -> None:
    """Users ``root``, ``kvstore-node`` (read and write under ``key_prefix``) and
    ``kvstore-reader`` (read), authenticated by their certificates' common names; then auth
    on. Done as ``root`` before auth is on (etcd allows anything then)."""
    credentials = grpc.ssl_channel_credentials(
        tls.ca_file.read_bytes(), tls.root_key_file.read_bytes(), tls.root_cert_file.read_bytes()
    )
    start = key_prefix.rstrip("/").encode() + b"/"
    end = start[:-1] + bytes([start[-1] + 1])
    with grpc.secure_channel(endpoint, credentials) as channel:
        auth = rpc.AuthStub(channel)
        for user, role, perm in (
            (ROOT_USER, "root", None),
            (NODE_USER, NODE_USER, rpc.Permission.READWRITE),
            (READER_USER, READER_USER, rpc.Permission.READ),
        ):
            options = rpc.UserAddOptions(no_password=True)
            auth.UserAdd(rpc.AuthUserAddRequest(name=user, options=options), timeout=10)
            if perm is not None:
                auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=10)
                permission = rpc.Permission(permType=perm, key=start, range_end=end)
                request = rpc.AuthRoleGrantPermissionRequest(name=role, perm=permission)
                auth.RoleGrantPermission(request, timeout=10)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=role), timeout=10)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)


def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def etcd_pid(root: Path) -> int | None:
    """The pid of ``root``'s running etcd, or None."""
    path = root / ETCD_PID_FILE
    if not path.exists():
        return None
    pid = int(path.read_text())
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return (
        pid
        if argv and argv[0].endswith(b"etcd") and str(root).encode() in b" ".join(argv)
        else None
    )


def stop_etcd(root: Path) -> int | None:
    """Stop ``root``'s etcd (SIGTERM, then SIGKILL); return the pid it had, or None."""
    pid = etcd_pid(root)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline_s = time.monotonic() + STOP_TIMEOUT_S
    while etcd_pid(root) == pid and time.monotonic() < deadline_s:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(_POLL_S)
    if etcd_pid(root) == pid:
        os.kill(pid, signal.SIGKILL)
    (root / ETCD_PID_FILE).unlink(missing_ok=True)
    return pid
