"""A real small filesystem for disk-full tests: a tmpfs mounted for one test.

Mounting needs root (CI runs as root); elsewhere the tests that need it skip and say why.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` at ``path``, unmounted afterwards (also on failure)."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
    result = subprocess.run(mount, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the disk-full test (needs root): {result.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
