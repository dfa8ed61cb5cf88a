"""Run a command while spinning processes hold every core (``make test-load``).

    python tests/cpu_burner.py [--spinners N] -- COMMAND [ARG...]

The spinners are plain busy loops at the default priority, one per core unless told, so the
command's processes (pytest, the nodes it starts) compete for CPU as on a machine that other
work keeps busy. They end when the command ends, and by themselves if this process dies
(each checks its parent). Returns the command's exit status. Only stdlib.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

_CHECK_EVERY = 2_000_000  # loop turns between checks that the parent is still alive


def _spin(parent: int) -> None:
    """Busy-loop until the parent is gone (then this process was reparented)."""
    while os.getppid() == parent:
        for _ in range(_CHECK_EVERY):
            pass
    os._exit(0)


def start_spinners(count: int) -> list[int]:
    parent = os.getpid()
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _spin(parent)
        pids.append(pid)
    return pids


def stop_spinners(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 2)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    spinners = start_spinners(args.spinners)
    try:
        proc = subprocess.Popen(command)

        def forward(signum: int, frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        print(f"cpu_burner: {len(spinners)} spinners hold the cores", file=sys.stderr)
        return proc.wait()
    finally:
        stop_spinners(spinners)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
