"""Background processes of a local cluster (nodes, etcd): one way to start them."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


def spawn_logged(command: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session (a Ctrl-C at the terminal does not reach it),
    stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
