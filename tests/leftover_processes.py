"""Processes a test run started and left running, found by a marker in their environment.

Every process a test starts inherits the test session's environment, whoever its parent is
later: node processes in sessions of their own, clusters daemonised by ``kvstore cluster up``,
serving workers. So one variable, ``KVSTORE_TEST_SESSION``, finds them all in
``/proc/*/environ``. The marker is a path of ids: a run nested in another appends its own id
(``outer/inner``), so a sweep of ``outer`` also finds what the inner run left, and a sweep of
``outer/inner`` never touches the outer run's processes.

Two sweeps use this module, one place for the logic:

- tests/conftest.py sets the marker at session start and sweeps at session end (the session
  fails and names what it found);
- ``python tests/leftover_processes.py run -- CMD...`` (``make test``, the integration venvs'
  runs in tests/engine_adapter/integrations/run.sh) runs pytest under a marker of its own and
  sweeps after it exits however it ended: a timeout of pytest-timeout's ``thread`` method or a
  SIGKILL leave no session end to sweep at.

Only stdlib: the integration venvs run it with their own interpreters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MARKER = "KVSTORE_TEST_SESSION"
TERM_GRACE_S = 5.0  # SIGTERM, then SIGKILL what is still alive after this
_POLL_S = 0.05


@dataclass(frozen=True)
class Leftover:
    """A process that carries the marker."""

    pid: int
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid}: {self.cmdline}"


def new_marker(parent: str | None = None) -> str:
    """A marker of a new run: a fresh id, under ``parent``'s when the run is nested."""
    run_id = uuid.uuid4().hex
    return f"{parent}/{run_id}" if parent else run_id


def carries(environ: bytes, marker: str) -> bool:
    """Whether a process environment (``/proc/PID/environ`` bytes) holds ``marker`` or a
    marker of a run nested in it."""
    prefix = f"{MARKER}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            value = entry[len(prefix) :].decode(errors="replace")
            return value == marker or value.startswith(marker + "/")
    return False


def _carries_pid(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return carries(f.read(), marker)
    except OSError:  # gone, or not ours to read
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def parent_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def is_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def self_and_ancestors() -> set[int]:
    """This process and its ancestors: they may carry the marker, and are never swept."""
    pids, pid = set(), os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        pid = parent_pid(pid)
    return pids


def live_pids() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def find(marker: str, exclude: Iterable[int] = ()) -> list[Leftover]:
    """Live processes carrying ``marker`` (zombies have an empty environ: not found)."""
    skip = set(exclude) | self_and_ancestors()
    return [
        Leftover(pid, _cmdline(pid))
        for pid in live_pids()
        if pid not in skip and _carries_pid(pid, marker)
    ]


def _signal(pid: int, marker: str, sig: signal.Signals) -> None:
    """Signal ``pid`` only if it still carries ``marker``: a pidfd pins the process, so a pid
    reused by another process meanwhile is never signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already
        return
    try:
        if _carries_pid(pid, marker):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, sig)
    finally:
        os.close(pidfd)


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is our exited child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def kill(leftovers: Sequence[Leftover], marker: str, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM every leftover, wait up to ``grace_s`` for them to go, SIGKILL the rest."""
    for leftover in leftovers:
        _signal(leftover.pid, marker, signal.SIGTERM)
    deadline_s = time.monotonic() + grace_s
    alive = list(leftovers)
    while alive and time.monotonic() < deadline_s:
        time.sleep(_POLL_S)
        for leftover in alive:
            _reap(leftover.pid)
        alive = [p for p in alive if _carries_pid(p.pid, marker)]
    for leftover in alive:
        _signal(leftover.pid, marker, signal.SIGKILL)
        _reap(leftover.pid)


def sweep(marker: str, exclude: Iterable[int] = ()) -> list[Leftover]:
    """Kill every process carrying ``marker`` (but this one and its ancestors); return them."""
    leftovers = find(marker, exclude)
    kill(leftovers, marker)
    return leftovers


def report(
    leftovers: Sequence[Leftover], where: str, pid_to_note: Mapping[int, str] | None = None
) -> str:
    """What a sweep found, a line per process (``pid_to_note``: a note to add to some)."""
    notes = pid_to_note or {}
    lines = [f"{len(leftovers)} process(es) outlived {where} (now killed):"]
    for leftover in leftovers:
        note = f"  ({notes[leftover.pid]})" if leftover.pid in notes else ""
        lines.append(f"  {leftover.describe()}{note}")
    return "\n".join(lines)


def run(command: Sequence[str]) -> int:
    """Run ``command`` under a marker of its own, then sweep what it left behind.

    SIGTERM is passed on to the command (pytest then tears its fixtures down); SIGINT is not
    (Ctrl-C reaches the whole foreground process group, the command included). This process
    keeps waiting, so the sweep runs however the command ends. Returns the command's exit
    status, or 1 if it passed but left processes.
    """
    marker = new_marker(os.environ.get(MARKER))
    proc = subprocess.Popen(command, env={**os.environ, MARKER: marker})

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    returncode = proc.wait()
    leftovers = sweep(marker)
    if not leftovers:
        return returncode
    print(report(leftovers, " ".join(command)), file=sys.stderr)
    return returncode or 1


def main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "run" and argv[1] == "--" and len(argv) > 2:
        return run(argv[2:])
    print(f"usage: {sys.argv[0]} run -- COMMAND [ARG...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
