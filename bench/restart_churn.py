"""``kvstore bench repair --restart-churn``: issue 38's restart window, over and over under load.

Each cycle takes three nodes (the next three, round robin) and, ``--churn-every-s`` apart:

    1. kills the first (one node down), puts and gets going on;
    2. kills the second while puts go on (two down);
    3. restarts the second, which returns once it answers Health as serving, and kills the
       third at once: from here every put needs the returning node (10 of 12 shards, 10 up),
       whose channel the client last saw refused. This is the **window**: the puts that
       finish in the next ``--churn-every-s`` are counted on their own;
    4. restarts the first and the third, and lets the cluster run whole for one step.

At most two nodes are down at any time, so a put can always be acknowledged: every failed put
is the client's (issue 38's target is 0). Gets do miss existing blocks here, by the code's
arithmetic: a block written while two nodes were down has 10 shards (k = 10, m = 2), and until
repair rebuilds the other two, any third node down or not yet rebuilt leaves it unreadable
(the heal and the read-back then find it whole). Blocks preloaded with every node up have 12
shards and must never miss; ``misses_of_preloaded`` counts those that did. The load, the
preload, the heal and the read-back of every acknowledged block are bench/repair_churn.py's
(``measure`` with these faults).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from rich.table import Table

from bench import repair_churn
from bench.repair_churn import Tally
from deploy.local_cluster import LocalCluster
from kvstore.errors import Unavailable

NODES_PER_CYCLE = 3


async def restart_cycles(
    cluster: LocalCluster, args: argparse.Namespace, tally: Tally
) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """Run restart-window cycles for ``args.churn_seconds``; one dict per cycle (no status
    timings: bench/repair_churn.py's round-robin churn has those)."""
    node_ids = [n.id for n in cluster.config.nodes]
    step_s = args.churn_every_s
    cycles: list[dict[str, Any]] = []
    started_s = time.monotonic()
    while time.monotonic() - started_s < args.churn_seconds:
        first = NODES_PER_CYCLE * len(cycles)
        down, returning, third = (node_ids[(first + i) % len(node_ids)] for i in range(3))
        cluster.kill_node(down)
        await asyncio.sleep(step_s)
        cluster.kill_node(returning)
        await asyncio.sleep(step_s)
        restart_s = time.monotonic()
        serving = await _restart(cluster, returning)
        cycle: dict[str, Any] = {
            "down": down,
            "returning": returning,
            "killed_at_return": third,
            "restart_s": round(time.monotonic() - restart_s, 2),
            "serving": serving,
        }
        if serving:  # else a third kill would leave 9 nodes: no put could succeed
            cluster.kill_node(third)
            cycle.update(await _window(tally, step_s))
        for node_id in (down, third) if serving else (down,):
            await _restart(cluster, node_id)
        cycles.append(cycle)
        await asyncio.sleep(step_s)
    return cycles, []


async def _restart(cluster: LocalCluster, node_id: str) -> bool:
    """Restart a node; True once it serves, False if not within its start-up timeout."""
    try:
        await asyncio.to_thread(cluster.restart_node, node_id)
    except Unavailable:
        return False
    return True


async def _window(tally: Tally, seconds: float) -> dict[str, Any]:
    """Puts finished and failed, gets and gets that missed an existing block, over the next
    ``seconds`` (the returning node's window)."""
    before = _counts(tally)
    await asyncio.sleep(seconds)
    after = _counts(tally)
    return {f"window_{name}": after[name] - before[name] for name in before}


def _counts(tally: Tally) -> dict[str, int]:
    failed = sum(tally.put_failures.values())
    return {
        "puts": tally.puts_acked + failed,
        "put_failures": failed,
        "gets": tally.gets,
        "misses": tally.misses_while_existing,
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Add the windows' totals to ``measure``'s JSON (``churn``); kills are three per cycle
    (one fewer where the returning node did not serve in time)."""
    churn = result["churn"]
    cycles = churn["cycles"]
    churn["restart_cycles"] = len(cycles)
    churn["kills"] = sum(2 + c["serving"] for c in cycles)
    churn["restart_window_puts"] = sum(c.get("window_puts", 0) for c in cycles)
    churn["restart_window_put_failures"] = sum(c.get("window_put_failures", 0) for c in cycles)
    churn["restart_window_gets"] = sum(c.get("window_gets", 0) for c in cycles)
    churn["restart_window_misses"] = sum(c.get("window_misses", 0) for c in cycles)
    return result


def table(results: dict[str, Any], args: argparse.Namespace) -> Table:
    """bench/repair_churn.py's table with the windows' rows."""
    churn = results["churn"]
    out = repair_churn.table(results, args)
    out.add_row("restart cycles (3 kills each)", str(churn["restart_cycles"]))
    out.add_row(
        "puts in the return windows / failed",
        f"{churn['restart_window_puts']} / {churn['restart_window_put_failures']}",
    )
    out.add_row(
        "gets in the return windows / missed",
        f"{churn['restart_window_gets']} / {churn['restart_window_misses']}",
    )
    return out
