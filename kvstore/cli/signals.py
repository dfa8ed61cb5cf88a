"""SIGTERM as an interrupt: ``kill``, ``timeout`` or a CI runner end a command as Ctrl-C does,
through its ``finally`` blocks, so the nodes and workers it started are stopped, not orphaned."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside: SIGTERM raises :class:`Terminated` in the main thread (the previous handler
    comes back on leaving)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
