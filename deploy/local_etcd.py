"""A single-member etcd on 127.0.0.1 for a local cluster (``kvstore cluster up --etcd``).

Runs the ``etcd`` binary (Debian's ``etcd-server`` package; ``make system-packages`` installs
it where it can) with its data in ``DIR/etcd`` and its log in ``DIR/logs/etcd.log``; its pid is
kept in ``DIR/etcd.pid`` so ``cluster down`` stops it. Real deployments point ``--etcd`` (or
``[membership] etcd``) at their own etcd cluster instead (deploy/systemd, deploy/k8s).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.processes import spawn_logged
from kvstore.errors import Unavailable

ETCD_PID_FILE = "etcd.pid"
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.05


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary, or None when it is not installed."""
    return shutil.which("etcd")


def start_etcd(
    root: Path,
    client_port: int,
    peer_port: int,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> str:
    """Start etcd for ``root`` in its own session; return its client endpoint once it answers.
    ``prefix`` runs it through another command (``ip netns exec NS``).

    Raises Unavailable (with the log's tail) when the binary is missing or etcd does not come
    up within STARTUP_TIMEOUT_S."""
    binary = etcd_binary()
    if binary is None:
        raise Unavailable(
            "no etcd binary: install Debian's etcd-server (`make system-packages` as root, or "
            "apt-get install etcd-server), or pass --etcd HOST:PORT of a running etcd"
        )
    client_url, peer_url = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
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
    return f"{host}:{client_port}"


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
