"""``kvstore bench repair``: what writes through a two-node outage cost, and what the heal costs.

One local 12-node cluster (fsync off unless ``--fsync``, scrub off), one client:

    1. healthy     N puts with every node up (latency, MB/s)
    2. degraded    two nodes killed, N more puts: they succeed with 10 of 12 shards (degraded
                   writes, client/write_path.py), each hinting its group's leader
    3. heal        the two nodes restart; time until every node holds all 2N shards and no
                   node reports a repair backlog; the nodes' CPU-seconds over that time beyond
                   what they burn idle (measured for 3 s first), and the repair figures from
                   Stats (shards rebuilt, bytes rebuilt and read)

With ``--churn`` instead (the issue #25 target): a node killed and restarted every
``--churn-every-s`` (15 s) for ``--churn-seconds`` (2 minutes), round robin, while
``--concurrency`` clients keep reading the blocks already written (70%) and writing new ones
(30%) with the cluster's ``timeout_s``; ``cluster status`` is timed once per cycle. Then the
nodes heal and every acknowledged block is read back. The JSON (``churn``): blocks lost (0),
wrong bytes (0), gets that missed while the block existed (acknowledged, never deleted), gets
that timed out (each reported as a TIMEOUT outcome, client/read_outcome.py, never a silent
None), get and put latency p50/p99/max against ``timeout_s``, puts refused, the heal's time
and the slowest ``cluster status``.

With ``--restart-churn``: the same load, preload, heal and read-back, but each cycle is issue
38's restart window (bench/restart_churn.py): one node down, a second killed and restarted,
a third killed as soon as the second serves; the JSON adds the puts that finished in those
windows and how many failed (the target is 0).

The figures for the choice between degraded writes and hinted handoff: repair reads k
survivor shards per shard it rebuilds (read bytes / rebuilt bytes ~ k) and decodes; a handoff
would instead write each missing shard once more at put time and move it once later (2 shard
transfers per missing shard), but on a cluster whose groups span every node it has no node to
hand off to that does not already hold a shard of the block (docs/operations.md, "Repair").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from bench import repair_churn, restart_churn
from bench.common import percentile_ms
from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from kvstore.cli.args import size_arg
from kvstore.cli.tables import print_fitted
from ttl.units import format_bytes

DOWN = ("n05", "n06")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--blocks", type=int, default=300, help="blocks per phase")
    parser.add_argument(
        "--block-bytes", type=size_arg, default=256 << 10, help="bytes per block (units allowed)"
    )
    parser.add_argument(
        "--repair-rate",
        type=size_arg,
        default=256 << 20,
        help="each node's repair_bytes_per_s (units allowed)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="puts in flight")
    parser.add_argument("--fsync", action="store_true", help="fsync on the nodes (default off)")
    parser.add_argument(
        "--churn",
        action="store_true",
        help="kill and restart a node every --churn-every-s under load (module docstring)",
    )
    parser.add_argument(
        "--restart-churn",
        action="store_true",
        help="--churn whose cycles are issue 38's restart window (bench/restart_churn.py); "
        "--churn-every-s is then the time between a cycle's faults",
    )
    parser.add_argument("--churn-seconds", type=float, default=120.0, help="churn duration")
    parser.add_argument("--churn-every-s", type=float, default=15.0, help="one kill per this")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the clients' timeout_s")


async def _put_phase(
    kv: KVClient, keys: list[bytes], block_bytes: int, concurrency: int
) -> dict[str, float]:
    rng = random.Random(len(keys))
    latencies_s: list[float] = []
    start_s = time.perf_counter()
    for first in range(0, len(keys), concurrency):

        async def put(key: bytes) -> None:
            begin_s = time.perf_counter()
            await kv.put(key, rng.randbytes(block_bytes))
            latencies_s.append(time.perf_counter() - begin_s)

        await asyncio.gather(*(put(k) for k in keys[first : first + concurrency]))
    elapsed_s = time.perf_counter() - start_s
    return {
        "puts": len(keys),
        "mb_per_s": len(keys) * block_bytes / elapsed_s / 1e6,
        "p50_ms": percentile_ms(latencies_s, 50),
        "p99_ms": percentile_ms(latencies_s, 99),
    }


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU-seconds of these processes so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICKS_PER_S


async def _idle_cpu_s_per_s(cluster: LocalCluster, seconds: float = 3.0) -> float:
    """The nodes' CPU-seconds per second with no requests (upkeep, scrub off, repair loops)."""
    pids = [proc.pid for proc in cluster.procs.values()]
    before_s = _cpu_s(pids)
    await asyncio.sleep(seconds)
    return (_cpu_s(pids) - before_s) / seconds


async def _heal(
    kv: KVClient, cluster: LocalCluster, num_shards: int, idle_cpu_s_per_s: float
) -> dict[str, Any]:
    """Restart the downed nodes; wait until every node has ``num_shards`` and no backlog."""
    for node_id in DOWN:
        cluster.restart_node(node_id)
    pids = [proc.pid for proc in cluster.procs.values()]
    cpu_before_s, start_s = _cpu_s(pids), time.perf_counter()
    while True:
        stats = await kv.node_stats(timeout_s=2.0)
        up = [s for s in stats.values() if s is not None]
        backlog = sum(s.repair.backlog_shards for s in up)
        if len(up) == len(stats) and all(s.shards == num_shards for s in up) and not backlog:
            break
        if time.perf_counter() - start_s > 600:
            raise RuntimeError(f"repair did not finish in 600 s (backlog {backlog})")
        await asyncio.sleep(0.2)
    heal_s = time.perf_counter() - start_s
    rebuilt_bytes = sum(s.repair.rebuilt_bytes for s in up)
    read_bytes = sum(s.repair.read_bytes for s in up)
    # CPU beyond what the nodes burn idle over the same time: the heal's own cost.
    cpu_s = max(0.0, _cpu_s(pids) - cpu_before_s - idle_cpu_s_per_s * heal_s)
    return {
        "heal_s": heal_s,
        "rebuilt_shards": sum(s.repair.rebuilt_shards for s in up),
        "rebuilt_bytes": rebuilt_bytes,
        "repair_read_bytes": read_bytes,
        "read_per_rebuilt_byte": read_bytes / rebuilt_bytes if rebuilt_bytes else 0.0,
        "rebuilt_mb_per_s": rebuilt_bytes / heal_s / 1e6,
        "node_cpu_s": cpu_s,
        "idle_node_cpu_s_per_s": idle_cpu_s_per_s,
        "node_cpu_s_per_rebuilt_gb": cpu_s / (rebuilt_bytes / 1e9) if rebuilt_bytes else 0.0,
        "handoff_transfer_bytes": 2 * rebuilt_bytes,
    }


async def _measure(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    keys = block_keys(list(range(8 * args.blocks)), 4, "repair-bench", "salt")
    healthy, degraded = keys[: args.blocks], keys[args.blocks : 2 * args.blocks]
    async with KVClient.connect(cluster.cluster_toml, tenant="bench") as kv:
        results = {"healthy": await _put_phase(kv, healthy, args.block_bytes, args.concurrency)}
        idle_cpu_s_per_s = await _idle_cpu_s_per_s(cluster)
        for node_id in DOWN:
            cluster.kill_node(node_id)
        results["degraded"] = await _put_phase(kv, degraded, args.block_bytes, args.concurrency)
        # The last puts return with their shards for the down nodes still being retried in
        # the background: settle them before the heal restarts those nodes, or a retry lands
        # on a restarted node (the restart blocks the event loop) and its put is not degraded.
        await kv.settle_puts()
        results["degraded"]["degraded_puts"] = kv.write_counters.num_degraded_puts
        results["heal"] = await _heal(kv, cluster, 2 * args.blocks, idle_cpu_s_per_s)
    return results


def _table(results: dict[str, Any], args: argparse.Namespace) -> Table:
    table = Table(title=f"{args.blocks} puts per phase, {format_bytes(args.block_bytes)} blocks")
    for column in ("phase", "MB/s", "p50 ms", "p99 ms", "note"):
        table.add_column(column, justify="left" if column in ("phase", "note") else "right")
    for phase in ("healthy", "degraded"):
        r = results[phase]
        note = f"{r.get('degraded_puts', 0)} degraded" if phase == "degraded" else "12 up"
        table.add_row(
            phase, f"{r['mb_per_s']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", note
        )
    heal = results["heal"]
    table.add_row(
        "heal",
        f"{heal['rebuilt_mb_per_s']:.1f}",
        "-",
        "-",
        f"{heal['heal_s']:.1f} s, {heal['rebuilt_shards']} shards, read/rebuilt "
        f"{heal['read_per_rebuilt_byte']:.1f}, {heal['node_cpu_s_per_rebuilt_gb']:.0f} CPU-s/GB",
    )
    return table


def _run_mode(cluster: LocalCluster, args: argparse.Namespace) -> tuple[dict[str, Any], Table]:
    """The phases ``--restart-churn``, ``--churn`` or neither asks for: (JSON, table)."""
    if args.restart_churn:
        churn = repair_churn.measure(cluster, args, restart_churn.restart_cycles)
        results = restart_churn.summarize(asyncio.run(churn))
        return results, restart_churn.table(results, args)
    if args.churn:
        results = asyncio.run(repair_churn.measure(cluster, args))
        return results, repair_churn.table(results, args)
    results = asyncio.run(_measure(cluster, args))
    return results, _table(results, args)


def run(args: argparse.Namespace) -> int:
    overrides = {
        "scrub_bytes_per_s": 0,
        "fsync": args.fsync,
        "repair_bytes_per_s": args.repair_rate,
        # The churn runs repair as deployed: passes on triggers, the periodic one rarely.
        "repair_scan_interval_s": 600.0 if args.churn or args.restart_churn else 5.0,
    }
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-repair-bench-") as tmp,
        LocalCluster.start(tmp, num_nodes=12, startup_timeout_s=180.0, **overrides) as cluster,
    ):
        load_before = os.getloadavg()[0]
        results, table = _run_mode(cluster, args)
    results["load_average_before"] = load_before
    results["load_average"] = os.getloadavg()[0]
    print_fitted(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
