"""A kvstore command with the read path's methods timed in thread CPU time, per call.

    PYTHONPATH=TREE python docs/runs/swapin-2core/stop52/thread_cpu.py bench swapin \
        --transport local --no-fsync --rounds 20 --model random:1b --dtype bfloat16 \
        --num-blocks 256 [--chunk-blocks 256]

Wraps, where the tree has them, the batch read's per-answer methods (event loop), the local
link's landing (its receiver threads) and their parts, and prints calls, total and per-call
thread CPU time at exit. ``MAX_KEYS=N`` sets the keys per node request.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import client.batch_decode as decode
import client.batch_read as batch_read
import client.local.link as link
import client.readiness as readiness
from kvstore.cli.commands import main

_stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
_lock = threading.Lock()


def _timed(owner: Any, name: str, label: str) -> None:
    function: Callable[..., Any] | None = getattr(owner, name, None)
    if function is None:
        return

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            with _lock:
                _stats[label][0] += 1
                _stats[label][1] += time.thread_time() - started

    setattr(owner, name, timed)


def _report() -> None:
    for label, (calls, total) in sorted(_stats.items(), key=lambda item: -item[1][1]):
        print(
            f"{label:22s} calls {int(calls):7d} total {total * 1e3:9.1f} ms  "
            f"per call {total / calls * 1e6:8.1f} us",
            file=sys.stderr,
        )


if __name__ == "__main__":
    if os.environ.get("MAX_KEYS"):
        batch_read.MAX_KEYS_PER_REQUEST = int(os.environ["MAX_KEYS"])
    for owner, name, label in [
        (batch_read._State, "_absorb", "absorb (loop)"),
        (batch_read._State, "_tally", "tally"),
        (batch_read._State, "_note_heard", "note_heard"),
        (batch_read._State, "_ask_reserves", "ask_reserves"),
        (batch_read._State, "_plan", "plan"),
        (batch_read._State, "follow_up", "follow_up"),
        (decode.BlockChecks, "_check_whole", "check_whole"),
        (readiness.Readiness, "landed", "readiness.landed"),
        (link.LocalLink, "_land", "land (receiver)"),
        (link.LocalLink, "submit", "submit"),
        (link.LocalLink, "_copy_streamed", "copy_streamed"),
        (link.LocalLink, "_placed_payloads", "placed_payloads"),
        (link.LocalLink, "_placed_starts", "placed_starts"),
        (link, "header_rows", "header_rows"),
        (link, "landing_regions", "landing_regions"),
        (link.batch_answer, "decode_table", "decode_table"),
    ]:
        _timed(owner, name, label)
    atexit.register(_report)
    sys.argv = ["kvstore", *sys.argv[1:]]
    main()
