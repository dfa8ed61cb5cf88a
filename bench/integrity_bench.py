"""``kvstore bench integrity``: what a keyed block version costs next to xxh3-128.

::

    kvstore bench integrity [--block-bytes 4MiB] [--seconds 1] [--threads 1,2] [--rounds 3]
                            [--json PATH]

A reader checks each block once: xxh3-128 for a plain tenant, the tenant's keyed BLAKE3 for one
under end-to-end integrity (client/integrity.py), so the difference between the two is what
integrity costs. For each digest and thread count, every thread hashes its own block (in
cache, as after decoding) back to back; CPU-seconds per GB is the process's CPU time over the
bytes hashed (the cost whatever the load), GB/s the wall-clock rate. ``blake3-auto`` lets
BLAKE3 split one block over its own threads (``max_threads=AUTO``: lower latency for one block,
the same CPU). Passes are interleaved over ``--rounds``; each record keeps the median pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
from rich.console import Console
from rich.table import Table

from client.integrity import BlockIntegrity
from erasure.shard import block_checksum
from kvstore.cli.args import list_arg, size_arg
from ttl.units import size_label

Digest = Callable[[bytes], bytes]


def _digests() -> dict[str, Digest]:
    keyed = BlockIntegrity("acme", bytes(range(32)))
    key = bytes(range(32))
    return {
        "xxh3-128": block_checksum,
        "blake3-keyed": lambda block: keyed.version(b"k" * 16, block),
        "blake3-auto": lambda block: blake3.blake3(
            block, key=key, max_threads=blake3.blake3.AUTO
        ).digest(16),
    }


def _pass(digest: Digest, num_threads: int, block_bytes: int, seconds: float) -> dict[str, float]:
    """One pass: ``num_threads`` threads hash their own block for ``seconds``."""
    blocks = [os.urandom(block_bytes) for _ in range(num_threads)]
    counts = [0] * num_threads
    stop_s = time.perf_counter() + seconds

    def work(index: int) -> None:
        block = blocks[index]
        while time.perf_counter() < stop_s:
            digest(block)
            counts[index] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    cpu_start_s, wall_start_s = time.process_time(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu_s, wall_s = time.process_time() - cpu_start_s, time.perf_counter() - wall_start_s
    gigabytes = sum(counts) * block_bytes / 1e9
    return {"cpu_s_per_gb": cpu_s / gigabytes, "gb_per_s": gigabytes / wall_s}


def run_bench(
    block_bytes: int, seconds: float, thread_counts: list[int], rounds: int
) -> list[dict[str, Any]]:
    digests = _digests()
    passes: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(rounds):
        for threads in thread_counts:
            for name, digest in digests.items():
                result = _pass(digest, threads, block_bytes, seconds / rounds)
                passes.setdefault((name, threads), []).append(result)
    records = []
    for (name, threads), results in passes.items():
        median = {
            field: statistics.median(r[field] for r in results)
            for field in ("cpu_s_per_gb", "gb_per_s")
        }
        records.append({"digest": name, "threads": threads, "block_bytes": block_bytes, **median})
    for record in records:
        xxh3 = next(
            r for r in records if r["digest"] == "xxh3-128" and r["threads"] == record["threads"]
        )
        record["cpu_vs_xxh3"] = record["cpu_s_per_gb"] / xxh3["cpu_s_per_gb"]
    return records


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-bytes", type=size_arg, default=4 << 20, help="block size")
    parser.add_argument("--seconds", type=float, default=1.0, help="per digest and thread count")
    parser.add_argument(
        "--threads", type=list_arg(int), default=[1, 2], help="thread counts, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes (median kept)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")


def run(args: argparse.Namespace) -> int:
    records = run_bench(args.block_bytes, args.seconds, args.threads, args.rounds)
    table = Table(title=f"block digests, {size_label(args.block_bytes)} blocks")
    for column in ("digest", "threads", "CPU-s per GB", "GB/s", "CPU vs xxh3-128"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(
            r["digest"],
            str(r["threads"]),
            f"{r['cpu_s_per_gb']:.3f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['cpu_vs_xxh3']:.1f}x",
        )
    Console().print(table)
    if args.json is not None:
        meta = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count()}
        args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0
