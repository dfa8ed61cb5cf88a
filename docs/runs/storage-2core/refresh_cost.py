"""CPU per batch read of one node's store: the same 96 keys (400 kB shards) read over and
over in batches of 8, as a node serves `bench storage --batch 8`, with the tick's flush after
each 0.5 s of reads; ``[ttl] refresh_granularity_s`` 0 (every hit's refresh rewrites its index
entry at the flush, as before) against 60. Run from the repository root:

    .venv/bin/python docs/runs/storage-2core/refresh_cost.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())

from kvstore.byte_arena import Region
from kvstore.config import NodeConfig, TrafficClasses, TTLConfig
from kvstore.store.shard_store import ShardStore
from tests.kvstore.node_harness import make_shard
from ttl.clock import RealClock

NUM_KEYS, BATCH, SHARD_BYTES, FLUSH_S = 96, 8, 400_000, 0.5


def cpu_us_per_batch(granularity_s: float, seconds: float = 3.0) -> float:
    with tempfile.TemporaryDirectory() as directory:
        node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", directory, fsync=False)
        classes = TrafficClasses({"chat": 7 * 86400.0})
        ttl = TTLConfig(classes=classes, refresh_granularity_s=granularity_s)
        store = ShardStore(node, ttl, RealClock())
        keys = [i.to_bytes(16, "big") for i in range(NUM_KEYS)]
        store.put("acme", "chat", [(k, make_shard(os.urandom(SHARD_BYTES))) for k in keys])
        buffer = memoryview(bytearray(BATCH * (SHARD_BYTES + 1024)))
        reads, cpu_s, started = 0, time.process_time(), time.monotonic()
        next_flush = started + FLUSH_S
        while time.monotonic() - started < seconds:
            first = reads * BATCH % NUM_KEYS
            batch = keys[first : first + BATCH]
            store.read_batch("acme", batch, b"", lambda n: Region(None, 0, buffer[:n]))
            reads += 1
            if time.monotonic() >= next_flush:
                store.flush()
                next_flush += FLUSH_S
        cpu_s = time.process_time() - cpu_s
        store.close()
        return cpu_s / reads * 1e6


if __name__ == "__main__":
    for granularity_s in (0.0, 60.0, 0.0, 60.0):
        us = cpu_us_per_batch(granularity_s)
        print(f"refresh_granularity_s {granularity_s:4.0f}: {us:6.1f} us CPU per batch read")
