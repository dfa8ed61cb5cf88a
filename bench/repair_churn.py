"""``kvstore bench repair --churn``: a node killed and restarted every 15 s for 2 minutes under
load, then the heal, then every acknowledged block read back (bench/repair_bench.py has the
method; this module is its churn phase).

Each cycle kills the next node (round robin) with SIGKILL and starts it again at once (the
restart takes what the machine's load makes it take; the next kill comes ``--churn-every-s``
after this one, or when the restart is done if that is later: one node down at a time). The
clients read with ``outcomes=True``, so a get that timed out is counted as a timeout, never as
a miss, and a miss of an acknowledged block is counted as one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.table import Table

from bench.common import percentile_ms
from client import KVClient, Outcome, block_keys
from deploy.local_cluster import LocalCluster
from kvstore.errors import KVStoreError, Unavailable
from ttl.units import format_bytes

GET_SHARE = 0.7
HEAL_TIMEOUT_S = 600.0
VERIFY_TIMEOUT_S = 60.0
PRELOAD_TIMEOUT_S = 60.0
LAG_PROBE_S = 0.05


@dataclass
class Tally:
    """What the clients saw during the churn."""

    gets: int = 0
    hits: int = 0
    misses_while_existing: int = 0
    # Of those, misses of preloaded blocks (written with every node up: 12 shards each, so
    # readable whenever at most 2 nodes are down; a miss of one is the read path's).
    misses_of_preloaded: int = 0
    preloaded: frozenset[bytes] = frozenset()
    timeouts_reported: int = 0
    wrong_bytes: int = 0
    puts: int = 0
    puts_acked: int = 0
    put_failures: dict[str, int] = field(default_factory=dict)
    get_latencies_s: list[float] = field(default_factory=list)
    put_latencies_s: list[float] = field(default_factory=list)
    loop_lags_s: list[float] = field(default_factory=list)


# The faults of a run: (cluster, args, the clients' tally) -> (cycles, status timings).
Churn = Callable[
    [LocalCluster, argparse.Namespace, Tally],
    Awaitable[tuple[list[dict[str, Any]], list[dict[str, float]]]],
]


async def measure(
    cluster: LocalCluster, args: argparse.Namespace, churn: Churn | None = None
) -> dict[str, Any]:
    """Preload, churn under load (``churn``: the faults; default one node killed and
    restarted per cycle), heal, verify; the JSON's ``churn`` figures."""
    rng = random.Random(7)
    keys = iter(block_keys(list(range(4 * 200_000)), 4, "repair-churn", "salt"))
    acked: dict[bytes, bytes] = {}
    async with KVClient.connect(cluster.cluster_toml, tenant="bench") as kv:
        for _ in range(args.blocks):
            key, block = next(keys), rng.randbytes(args.block_bytes)
            await kv.put(key, block, timeout_s=PRELOAD_TIMEOUT_S)
            acked[key] = block
        tally = Tally(preloaded=frozenset(acked))
        stop = asyncio.Event()
        load = [
            asyncio.create_task(_client(kv, acked, keys, args, tally, stop, seed))
            for seed in range(args.concurrency)
        ]
        lag = asyncio.create_task(_loop_lag(tally, stop))
        cycles, statuses = await (churn or _churn)(cluster, args, tally)
        stop.set()
        await asyncio.gather(*load, lag)
        heal_s = await _heal(kv, len(acked))
        lost, wrong = await _verify(kv, acked)
        counters = kv.counters()
    figures = _figures(args, tally, cycles, statuses, heal_s, len(acked), lost, wrong)
    return {"churn": {**figures, "client_counters": counters}}


async def _client(
    kv: KVClient,
    acked: dict[bytes, bytes],
    keys: Any,
    args: argparse.Namespace,
    tally: Tally,
    stop: asyncio.Event,
    seed: int,
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        if rng.random() < GET_SHARE:
            await _get(kv, acked, rng.choice(list(acked)), args.timeout_s, tally)
        else:
            await _put(kv, acked, next(keys), rng.randbytes(args.block_bytes), args, tally)


async def _get(
    kv: KVClient, acked: dict[bytes, bytes], key: bytes, timeout_s: float, tally: Tally
) -> None:
    started_s = time.monotonic()
    result = await kv.get_batch([key], timeout_s=timeout_s, outcomes=True)
    tally.get_latencies_s.append(time.monotonic() - started_s)
    tally.gets += 1
    outcome, block = result.outcomes[0], result.blocks[0]
    if outcome is Outcome.HIT:
        tally.hits += 1
        tally.wrong_bytes += block != acked[key]
    elif outcome is Outcome.MISS:
        tally.misses_while_existing += 1
        tally.misses_of_preloaded += key in tally.preloaded
    else:
        tally.timeouts_reported += 1


async def _put(
    kv: KVClient,
    acked: dict[bytes, bytes],
    key: bytes,
    block: bytes,
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    started_s = time.monotonic()
    tally.puts += 1
    try:
        await kv.put(key, block, timeout_s=args.timeout_s)
    except KVStoreError as exc:
        name = type(exc).__name__
        tally.put_failures[name] = tally.put_failures.get(name, 0) + 1
    else:
        acked[key] = block
        tally.puts_acked += 1
    tally.put_latencies_s.append(time.monotonic() - started_s)


async def _loop_lag(tally: Tally, stop: asyncio.Event) -> None:
    """How late the client's event loop wakes from a 50 ms sleep: a deadline cannot fire
    sooner than the loop runs, so this is the part of any overshoot the host's load causes."""
    while not stop.is_set():
        started_s = time.monotonic()
        await asyncio.sleep(LAG_PROBE_S)
        tally.loop_lags_s.append(time.monotonic() - started_s - LAG_PROBE_S)


async def _churn(
    cluster: LocalCluster, args: argparse.Namespace, tally: Tally
) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """Kill and restart a node per cycle; time ``cluster status`` (one at a time, started
    while a node is down). Returns the cycles and the status timings."""
    node_ids = [n.id for n in cluster.config.nodes]
    cycles: list[dict[str, Any]] = []
    statuses: list[asyncio.Task[tuple[float, float]]] = []
    started_s = time.monotonic()
    while time.monotonic() - started_s < args.churn_seconds:
        cycle_s = time.monotonic()
        victim = node_ids[len(cycles) % len(node_ids)]
        cluster.kill_node(victim)
        if not statuses or statuses[-1].done():  # one at a time: each its own measurement
            statuses.append(asyncio.create_task(_time_status(cluster)))  # while a node is down
        try:
            await asyncio.to_thread(cluster.restart_node, victim)
            serving = True
        except Unavailable:  # not healthy within its start-up timeout: the heal waits for it
            serving = False
        cycles.append({"node": victim, "restart_s": time.monotonic() - cycle_s, "serving": serving})
        await asyncio.sleep(max(0.0, cycle_s + args.churn_every_s - time.monotonic()))
    timed = await asyncio.gather(*statuses)
    return cycles, [{"status_s": total_s, "status_own_s": own_s} for total_s, own_s in timed]


async def _time_status(cluster: LocalCluster) -> tuple[float, float]:
    """(seconds ``cluster status --json`` took, of which its own calls: etcd and Stats)."""
    started_s = time.monotonic()
    command = [sys.executable, "-m", "kvstore.cli", "cluster", "status", "--json"]
    proc = await asyncio.create_subprocess_exec(
        *command, "--dir", str(cluster.root), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    elapsed_s = time.monotonic() - started_s
    try:
        return elapsed_s, float(json.loads(out)["elapsed_s"])
    except (ValueError, KeyError):
        return elapsed_s, elapsed_s


async def _heal(kv: KVClient, num_blocks: int) -> float:
    """Seconds until every node holds every block's shard, with no backlog and no led group
    waiting for its listing (-1: not within HEAL_TIMEOUT_S)."""
    started_s = time.monotonic()
    while time.monotonic() - started_s < HEAL_TIMEOUT_S:
        stats = await kv.node_stats(timeout_s=10.0)
        up = [s for s in stats.values() if s is not None]
        whole = len(up) == len(stats) and all(s.shards == num_blocks for s in up)
        if whole and not sum(s.repair.backlog_shards + s.repair.pending_groups for s in up):
            return time.monotonic() - started_s
        await asyncio.sleep(0.5)
    return -1.0


async def _verify(kv: KVClient, acked: dict[bytes, bytes]) -> tuple[int, int]:
    """(acknowledged blocks not readable, blocks read back with wrong bytes)."""
    lost = wrong = 0
    keys = list(acked)
    for start in range(0, len(keys), 32):
        batch = keys[start : start + 32]
        got = await kv.get_batch(batch, timeout_s=VERIFY_TIMEOUT_S)
        lost += sum(block is None for block in got)
        wrong += sum(b is not None and b != acked[k] for k, b in zip(batch, got, strict=True))
    return lost, wrong


def _figures(
    args: argparse.Namespace,
    tally: Tally,
    cycles: list[dict[str, Any]],
    statuses: list[dict[str, float]],
    heal_s: float,
    num_acked: int,
    lost: int,
    wrong: int,
) -> dict[str, Any]:
    get_p99_ms = percentile_ms(tally.get_latencies_s, 99)
    figures = asdict(tally)
    for name in ("get_latencies_s", "put_latencies_s", "loop_lags_s", "preloaded"):
        figures.pop(name)
    over_s = args.timeout_s + 1.0
    figures["wrong_bytes"] += wrong
    return {
        **figures,
        "seconds": args.churn_seconds,
        "every_s": args.churn_every_s,
        "kills": len(cycles),
        "timeout_s": args.timeout_s,
        "block_bytes": args.block_bytes,
        "blocks_acked": num_acked,
        "blocks_lost": lost,
        "get_p50_ms": percentile_ms(tally.get_latencies_s, 50),
        "get_p99_ms": get_p99_ms,
        "get_max_ms": max(tally.get_latencies_s, default=0.0) * 1000,
        "get_p99_over_timeout": get_p99_ms / 1000 / args.timeout_s,
        "put_p50_ms": percentile_ms(tally.put_latencies_s, 50),
        "put_p99_ms": percentile_ms(tally.put_latencies_s, 99),
        "put_max_ms": max(tally.put_latencies_s, default=0.0) * 1000,
        "gets_over_timeout_plus_1s": sum(t > over_s for t in tally.get_latencies_s),
        "puts_over_timeout_plus_1s": sum(t > over_s for t in tally.put_latencies_s),
        "client_loop_lag_p99_ms": percentile_ms(tally.loop_lags_s, 99),
        "client_loop_lag_max_ms": max(tally.loop_lags_s, default=0.0) * 1000,
        "heal_s": heal_s,
        "status_s_max": max((t["status_s"] for t in statuses), default=0.0),
        "status_own_s_max": max((t["status_own_s"] for t in statuses), default=0.0),
        "statuses": statuses,
        "cycles": cycles,
    }


def table(results: dict[str, Any], args: argparse.Namespace) -> Table:
    r = results["churn"]
    title = (
        f"churn: {r['kills']} kills in {r['seconds']:.0f} s, {format_bytes(r['block_bytes'])} "
        f"blocks, timeout_s {r['timeout_s']:g}"
    )
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("blocks acknowledged / lost", f"{r['blocks_acked']} / {r['blocks_lost']}"),
        ("wrong bytes", str(r["wrong_bytes"])),
        ("gets: hits / missed while existing", f"{r['hits']} / {r['misses_while_existing']}"),
        ("gets that missed a preloaded block", str(r["misses_of_preloaded"])),
        ("gets timed out (reported as timeouts)", str(r["timeouts_reported"])),
        ("get p50 / p99 / max ms", _ms(r, "get")),
        ("get p99 / timeout_s", f"{r['get_p99_over_timeout']:.2f}"),
        ("client event loop lag p99 / max ms", _lag(r)),
        ("puts acked / refused", f"{r['puts_acked']} / {sum(r['put_failures'].values())}"),
        ("put p50 / p99 / max ms", _ms(r, "put")),
        ("heal after the churn", f"{r['heal_s']:.1f} s"),
        ("slowest cluster status (its own calls)", _status(r)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _lag(r: dict[str, Any]) -> str:
    return f"{r['client_loop_lag_p99_ms']:.0f} / {r['client_loop_lag_max_ms']:.0f}"


def _status(r: dict[str, Any]) -> str:
    return f"{r['status_s_max']:.1f} ({r['status_own_s_max']:.1f}) s"


def _ms(r: dict[str, Any], op: str) -> str:
    return f"{r[f'{op}_p50_ms']:.0f} / {r[f'{op}_p99_ms']:.0f} / {r[f'{op}_max_ms']:.0f}"
