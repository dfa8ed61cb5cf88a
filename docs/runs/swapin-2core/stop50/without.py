"""Run a kvstore command with one part of this stop's code switched off, for an A/B.

    python docs/runs/swapin-2core/stop50/without.py PART -- bench swapin ...

PART is one of:

``freeze``: the start-up heap is not frozen (``freeze_startup_heap`` does nothing).
``touches``: reads send no TTL touches (``FollowUps.touch`` does nothing): what the touches
cost, not a setting anyone should run (the unread shard would expire early).
``touch-batching``: touches flushed 50 ms after the first, as before 0.5 s batching.
Run from the repository root.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())

import bench.swapin_bench
import client.follow_ups
from kvstore.cli.commands import main

part, separator, *command = sys.argv[1:]
assert separator == "--", __doc__
if part == "freeze":
    bench.swapin_bench.freeze_startup_heap = lambda: None
elif part == "touches":
    client.follow_ups.FollowUps.touch = lambda self, node_ids, key, version: None
elif part == "touch-batching":
    client.follow_ups.TOUCH_FLUSH_S = client.follow_ups.FLUSH_DELAY_S
else:
    raise SystemExit(__doc__)
sys.argv = ["kvstore", *command]
sys.exit(main())
