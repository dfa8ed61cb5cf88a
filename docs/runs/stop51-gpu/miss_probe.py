"""Fetches of keys the store lacks (all misses) and of stored keys, through the engine's
connector as `bench swapin` builds it, timed; each case's median fetch's read stages, and a
cProfile of the miss fetches (the event loop's thread).

    python docs/runs/stop51-gpu/miss_probe.py --num-blocks N [--device cuda]
        [--model random:1b] [--dtype bfloat16] [--profile] [--fetches 20]

Run from the repository root (or a tree's root with PYTHONPATH at it).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time

from bench.common import bench_cluster
from bench.swapin_bench import Bench, configure, layout_for
from client.read_timeline import ReadTimeline
from engine_adapter.engine import freeze_startup_heap


async def main() -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--fetches", type=int, default=20)
    args = parser.parse_args([*sys.argv[1:], "--transport", "local", "--no-fsync"])
    b = Bench(args, layout_for(args))
    with bench_cluster(args) as (toml, _):
        await b.open(toml)  # writes the blocks under the bench's tenant
        runner = b.runners[0]
        freeze_startup_heap()
        stranger = "nobody-" + b.tenant
        cases = {
            "miss": (runner.connector.keys(b.token_ids, stranger), stranger),
            "hit": (b.keys(), b.tenant),
        }
        prof = cProfile.Profile()
        for label in ("miss", "hit", "miss", "hit"):
            keys, tenant = cases[label]
            kv = await runner.connector.client(tenant)
            times, timelines = [], []
            for _ in range(args.fetches):
                kv.timeline = ReadTimeline()
                if args.profile and label == "miss":
                    prof.enable()
                started = time.perf_counter()
                outcome = await runner.connector.fetch_prefix(keys, b.table, len(keys), tenant)
                times.append(time.perf_counter() - started)
                prof.disable()
                timelines.append(kv.timeline)
                b._finish_swap_in(outcome)
                runner.connector.release(outcome)
            kv.timeline = None
            order = sorted(range(len(times)), key=times.__getitem__)
            median = order[len(order) // 2]
            print(
                f"{label}: {len(keys)} blocks ({outcome.fallback}, "
                f"{outcome.num_fetched_blocks} used), median {times[median] * 1e3:.2f} ms, "
                f"min {times[order[0]] * 1e3:.2f} ms"
            )
            print(f"  median fetch's stages (ms): {timelines[median].stages_ms()}")
        await b.close()
        if args.profile:
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)


asyncio.run(main())
