"""The pid bookkeeping of a local cluster's directory (``pids.json``) and stopping its node
processes by pid, guarded against pid reuse (``kvstore cluster down`` and ``status``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
_POLL_S = 0.05


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


def refuse_running(root: Path) -> None:
    """InvalidArgument when nodes of a cluster in ``root`` still run (one ``up`` per DIR)."""
    if any(is_node_process(pid, n) for n, pid in read_pids(root).items()):
        raise InvalidArgument(
            f"a cluster is already running in {root}; run `kvstore cluster down --dir {root}`"
        )
