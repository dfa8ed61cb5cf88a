"""`kvstore bench swapin` with the nodes' CPU counted over its whole measured phase.

    python docs/runs/swapin-2core/stop50/nodes_whole_phase.py [--unbatched] -- bench swapin ...

The bench counts the nodes' CPU inside each fetch's window. Work a fetch causes later (the
TTL touches, batched for 0.5 s since this stop) can fall between windows, so this counts the
nodes' CPU from the first warm-up fetch to 0.6 s after the last one (the touches flushed),
idle burn and the gaps included, over every fetched byte: an upper bound where the bench's
figure is a lower one. ``--unbatched``: touches flushed 50 ms after the first, as before.
Run from the repository root.
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.getcwd())

import bench.swapin_bench
import client.follow_ups
from kvstore.cli.commands import main

unbatched = sys.argv[1] == "--unbatched"
command = sys.argv[3 if unbatched else 2 :]
if unbatched:
    client.follow_ups.TOUCH_FLUSH_S = client.follow_ups.FLUSH_DELAY_S
measure = bench.swapin_bench.measure


def nodes_cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def measured(benches: list[bench.swapin_bench.Bench]) -> None:
    pids = benches[0].node_pids
    before = nodes_cpu_s(pids)
    await measure(benches)
    await asyncio.sleep(0.6)
    spent = nodes_cpu_s(pids) - before
    args, layout = benches[0].args, benches[0].layout
    gb = (args.rounds + 1) * args.num_blocks * layout.block_bytes / 1e9 * len(benches[0].runners)
    label = "unbatched" if unbatched else "batched"
    print(f"{label}: nodes {spent:.3f} CPU-s over the phase, {spent / gb:.3f} per GB", flush=True)


bench.swapin_bench.measure = measured
sys.argv = ["kvstore", *command]
sys.exit(main())
