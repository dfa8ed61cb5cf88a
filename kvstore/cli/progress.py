"""Progress of long work, for every command: a bar on a terminal, plain lines elsewhere.

On a terminal, a transient rich bar on stderr. Anywhere else (CI logs, pipes, ``nohup``) a
bar would print nothing useful, so a line goes to stderr at most every ``interval_s``
(default 10 s, ``KVSTORE_PROGRESS_INTERVAL_S`` to change it) and once at the end::

    [kvstore] storage: 12/48 (25%), 61 s elapsed, about 183 s left (get 4MiB x8)
    [kvstore] storage: done, 48/48 in 240 s

::

    with ProgressReporter("storage", total=48) as progress:
        progress.update(description="get 4MiB x8")
        progress.advance()

Every command but the long-running services runs under a :class:`Heartbeat` (the command
table starts it): off a terminal, a command that printed no progress line for an interval gets
one saying it still runs, so no command is silent for minutes in a CI log::

    [kvstore] bench repair: running, 20 s elapsed
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress

DEFAULT_INTERVAL_S = 10.0
_last_line_s = time.monotonic()  # when any reporter of this process last printed a line


def _interval_s() -> float:
    try:
        return float(os.environ.get("KVSTORE_PROGRESS_INTERVAL_S", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


class ProgressReporter:
    """Progress of one piece of work of ``total`` steps (see the module docstring)."""

    def __init__(
        self,
        description: str,
        total: float,
        *,
        stream: IO[str] | None = None,
        interval_s: float | None = None,
        enabled: bool = True,
    ) -> None:
        self.description = description
        self.total = total
        self.completed = 0.0
        self.detail = ""
        self._stream = stream if stream is not None else sys.stderr
        self._interval_s = _interval_s() if interval_s is None else interval_s
        self._enabled = enabled
        self._start_s = self._last_line_s = time.monotonic()
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> ProgressReporter:
        if self._enabled and self._stream.isatty():
            from rich.console import Console  # a terminal only: rich takes a while to import
            from rich.progress import Progress

            self._bar = Progress(console=Console(file=self._stream), transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        elif self._enabled and exc_info[0] is None:
            elapsed_s = time.monotonic() - self._start_s
            self._line(f"done, {self._count()} in {elapsed_s:.0f} s")

    def advance(self, amount: float = 1.0) -> None:
        self.update(completed=self.completed + amount)

    def update(self, *, completed: float | None = None, description: str | None = None) -> None:
        """Set the steps done and/or what is being done now."""
        if completed is not None:
            self.completed = completed
        if description is not None:
            self.detail = description
        if self._bar is not None:
            label = f"{self.description}: {self.detail}" if self.detail else self.description
            self._bar.update(self._task, completed=self.completed, description=label)
            return
        now_s = time.monotonic()
        if self._enabled and now_s - self._last_line_s >= self._interval_s:
            self._last_line_s = now_s
            self._line(self._status(now_s - self._start_s))

    def _count(self) -> str:
        return f"{self.completed:g}/{self.total:g}"

    def _status(self, elapsed_s: float) -> str:
        status = f"{self._count()}"
        if self.total > 0:
            status += f" ({100 * self.completed / self.total:.0f}%)"
        status += f", {elapsed_s:.0f} s elapsed"
        if 0 < self.completed < self.total:
            status += f", about {elapsed_s * (self.total / self.completed - 1):.0f} s left"
        return status + (f" ({self.detail})" if self.detail else "")

    def _line(self, text: str) -> None:
        _progress_line(f"{self.description}: {text}", self._stream)


def _progress_line(text: str, stream: IO[str]) -> None:
    global _last_line_s
    _last_line_s = time.monotonic()
    print(f"[kvstore] {text}", file=stream, flush=True)


class Heartbeat:
    """Off a terminal, a line on ``stream`` every ``interval_s`` in which the command printed
    no progress line of its own (see the module docstring). A daemon thread; a context."""

    def __init__(
        self, command: str, *, stream: IO[str] | None = None, interval_s: float | None = None
    ) -> None:
        self.command = command
        self._stream = stream if stream is not None else sys.stderr
        self._interval_s = _interval_s() if interval_s is None else interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvstore-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        if not self._stream.isatty():
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _beat(self) -> None:
        start_s = time.monotonic()
        while not self._stop.wait(self._interval_s / 4):
            now_s = time.monotonic()
            if now_s - max(_last_line_s, start_s) >= self._interval_s:
                elapsed = f"running, {now_s - start_s:.0f} s elapsed"
                _progress_line(f"{self.command}: {elapsed}", self._stream)
