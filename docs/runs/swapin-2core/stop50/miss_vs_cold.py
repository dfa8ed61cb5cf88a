"""A cached prefill that misses every block against a cold one, alternating, on one engine.

    python docs/runs/swapin-2core/stop50/miss_vs_cold.py

The default model fp32 on CPU, 1,024 tokens, `bench engine`'s engine config, a local
12-node cluster; ten rounds (the first a warm-up), the order of the two flipped every round;
prints the medians and every run. Run from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, os.getcwd())

from bench import engine_bench
from deploy.local_cluster import LocalCluster
from engine_adapter.engine import Engine, freeze_startup_heap
from engine_adapter.loader import load_model


async def main() -> None:
    parser = argparse.ArgumentParser()
    engine_bench.configure(parser)
    args = parser.parse_args(["--prompt-lengths", "1024", "--json", os.devnull])
    config = engine_bench.engine_config(args, 1024, 4)
    engine = Engine(load_model(args.model, config.device, config.dtype, config.seed), config)
    with (
        tempfile.TemporaryDirectory() as work,
        LocalCluster.start(pathlib.Path(work), fsync=False) as cluster,
    ):
        engine.open_store(cluster.cluster_toml)
        freeze_startup_heap()
        prompt = engine_bench.make_prompt(1024, engine.model.config.vocab_size, 0)
        runs: dict[str, list[float]] = {"cold": [], "miss": [], "miss_fetch": []}
        for round_index in range(10):
            for kind in ("cold", "miss") if round_index % 2 == 0 else ("miss", "cold"):
                if kind == "cold":
                    result = await engine.prefill(prompt, use_cache=False)
                else:
                    result = await engine.prefill(prompt, tenant="miss", write_back=False)
                engine.release(result.sequence)
                if round_index:
                    runs[kind].append(result.ttft_s)
                    if kind == "miss":
                        runs["miss_fetch"].append(result.fetch_s)
        for kind, seconds in runs.items():
            print(kind, round(statistics.median(seconds), 4), [round(s, 3) for s in seconds])
        await engine.close()


asyncio.run(main())
