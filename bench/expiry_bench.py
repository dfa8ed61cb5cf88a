"""``kvstore bench expiry``: the cost of expiring blocks must not grow with the live blocks.

For each multiplier (0x, 10x, 100x by default) a fresh in-process ShardStore on a temporary
directory gets ``multiplier * N`` live chat blocks (7-day TTL) and N agent blocks (3-day TTL)
from a manual clock; the clock then moves 4 days on and one ``expire()`` pass is timed: it
deletes the N agent entries through the index's expiry order and frees their segment files.
The live blocks are never read, so the time per expired block should stay flat.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from rich.table import Table

from erasure.shard import ShardHeader, block_checksum, pack_header
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import print_fitted
from kvstore.config import NodeConfig, TTLConfig
from kvstore.store.index_backends import MemoryBackend
from kvstore.store.shard_store import ShardStore
from ttl.clock import ManualClock
from ttl.policy import DAY_S

log = logging.getLogger(__name__)
BATCH_BLOCKS = 1000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--expired-blocks", type=int, default=2000, help="N blocks to expire")
    parser.add_argument(
        "--live-multipliers", default="0,10,100", help="live blocks per expired block, comma list"
    )
    parser.add_argument("--block-bytes", type=int, default=64, help="payload bytes per block")
    parser.add_argument(
        "--backend",
        choices=("lmdb", "memory"),
        default="lmdb",
        help="index backend: lmdb (as on a node) or the in-memory twin",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; the median wins")


def _shard(i: int, block_bytes: int) -> bytes:
    payload = i.to_bytes(8, "big") * (block_bytes // 8 + 1)
    payload = payload[:block_bytes]
    header = ShardHeader("zfec", 1, 0, 0, len(payload), block_checksum(payload), len(payload))
    return pack_header(header, payload) + payload


def _fill(store: ShardStore, cls: str, first: int, num: int, args: argparse.Namespace) -> None:
    for start in range(first, first + num, BATCH_BLOCKS):
        stop = min(start + BATCH_BLOCKS, first + num)
        items = [(i.to_bytes(16, "big"), _shard(i, args.block_bytes)) for i in range(start, stop)]
        store.put("bench", cls, items)


def measure(live_blocks: int, args: argparse.Namespace) -> float:
    """Seconds one expire() pass takes to remove ``args.expired_blocks`` among live ones."""
    with tempfile.TemporaryDirectory(prefix="kvstore-expiry-") as tmp:
        node = NodeConfig("bench", "127.0.0.1:1", 0, "local", tmp, fsync=False)
        clock = ManualClock(1000 * DAY_S)
        backend = MemoryBackend() if args.backend == "memory" else None
        store = ShardStore(node, TTLConfig(), clock, backend)
        try:
            _fill(store, "chat", 0, live_blocks, args)
            _fill(store, "agent", live_blocks, args.expired_blocks, args)
            clock.advance(4 * DAY_S)
            start_s = time.perf_counter()
            num_expired = store.expire()
            elapsed_s = time.perf_counter() - start_s
        finally:
            store.close()
    assert num_expired == args.expired_blocks, f"expired {num_expired}, expected all agents"
    return elapsed_s


def _table(results: list[dict[str, float]]) -> Table:
    table = Table(title="expiry cost vs live blocks (one expire() pass, median)")
    for column in ("live blocks", "expired blocks", "expiry s", "us / expired block"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            f"{r['live_blocks']:,}",
            f"{r['expired_blocks']:,}",
            f"{r['expiry_s']:.4f}",
            f"{r['us_per_expired_block']:.1f}",
        )
    return table


def run(args: argparse.Namespace) -> int:
    multipliers = [int(m) for m in args.live_multipliers.split(",")]
    results = []
    with ProgressReporter("expiry bench", len(multipliers) * args.repeats) as progress:
        for multiplier in multipliers:
            live_blocks = multiplier * args.expired_blocks
            runs = []
            for _ in range(args.repeats):
                runs.append(measure(live_blocks, args))
                progress.advance()
            expiry_s = sorted(runs)[len(runs) // 2]
            results.append(
                {
                    "live_blocks": live_blocks,
                    "expired_blocks": args.expired_blocks,
                    "expiry_s": expiry_s,
                    "us_per_expired_block": expiry_s / args.expired_blocks * 1e6,
                }
            )
    print_fitted(_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
