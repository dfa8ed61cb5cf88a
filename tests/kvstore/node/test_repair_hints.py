"""Repair hints queued from the node's request pool while the repair loop walks them.

The audit's 66,000-hint QueueRepair broke the loop with "OrderedDict mutated during
iteration": ``queue`` ran in a pool thread, the walk on the event loop. A node now refuses
more than MAX_HINTS_PER_REQUEST hints per request (tests/kvstore/node/test_rpc_fuzz.py), and
the hints are guarded, so even many large batches from threads leave the walk intact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from deploy.local_cluster import local_config
from kvstore.node.repair_service import MAX_HINTS, RepairService
from ttl.clock import ManualClock


async def test_hints_queued_from_threads_while_the_loop_walks_them(tmp_path: Path) -> None:
    cluster = local_config(tmp_path, 12)
    service = RepairService(cluster, cluster.nodes[0], ManualClock(0.0))
    service.queue([("acme", i.to_bytes(16, "big"), i % 12) for i in range(50_000)])
    stop = threading.Event()

    def queue_batches() -> None:
        batch = [("globex", i.to_bytes(16, "big"), i % 12) for i in range(66_000)]
        while not stop.is_set():
            service.queue(batch)

    thread = threading.Thread(target=queue_batches)
    thread.start()
    try:
        for _ in range(10):
            service._due_hints(time.monotonic())  # the loop's walk: it raised RuntimeError
            await asyncio.sleep(0)
    finally:
        stop.set()
        thread.join()
        await service.close()
    assert service.stats.queued_hints == MAX_HINTS, "the hint queue lost its bound"
