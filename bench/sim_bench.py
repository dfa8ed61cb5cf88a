"""``kvstore bench sim``: simulator block accesses per second on one core.

::

    kvstore bench sim [--json PATH] [--days 2] [--seed 0] [--rounds 3] [--capacity-share 0.25]

The workload is ``kvstore sim generate``'s (chat and agent sessions, default parameters) over
``--days`` days, built in memory. Cases:

- ``dict-ttl``: the yardstick, a bare dict loop doing TTL alone (get, compare, set per access;
  no prefix rule, no footprint, no capacity);
- ``sim-ttl``: ``ttl.simulator`` with the TTL policy only (chat 7d, agent 3d);
- ``sim-ttl-capacity-expiry``: TTL plus a capacity of ``--capacity-share`` of the distinct
  blocks, evicting earliest expiry first (`eviction_order = "expiry"`);
- ``sim-ttl-capacity-lru``: the same capacity with LRU eviction (the store's default).

Rates are block accesses per second of this thread's CPU time (``time.thread_time``), so they
are per core even when other processes share the machine; ``wall_accesses_per_s`` is the
wall-clock figure. Cases run interleaved for ``--rounds`` passes and a record keeps the
median pass. The target (DESIGN.md) is 3 million accesses per second with TTL and capacity.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from kvstore.tables import print_fitted
from ttl.generate import WorkloadParams, generate_trace
from ttl.policy import EvictionOrder, TrafficClasses
from ttl.simulator import ALL, SimConfig, simulate
from ttl.traces import Trace

TARGET_ACCESSES_PER_S = 3e6
BASELINE = "dict-ttl"


@dataclass
class Record:
    case: str
    accesses_per_s: float  # median pass, per CPU second of this thread
    accesses_per_s_passes: list[float]
    wall_accesses_per_s: float
    num_accesses: int
    block_hit_ratio: float  # what the case computed (the baseline has no prefix rule)
    evicted_blocks: int
    vs_dict_baseline: float = 0.0
    meets_target: bool = False


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    parser.add_argument("--days", type=float, default=2.0, help="workload length (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes (default 3)")
    parser.add_argument(
        "--capacity-share", type=float, default=0.25,
        help="capacity as a share of the distinct blocks (default 0.25)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    trace = generate_trace(WorkloadParams(days=args.days, seed=args.seed))
    cases = make_cases(trace, round(args.capacity_share * trace.num_blocks))
    records = measure(cases, trace.num_accesses, args.rounds)
    print_table(records, trace)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document(args, trace, records), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


Case = tuple[str, Callable[[], tuple[float, int]]]  # name, run -> (block hit ratio, evicted)


def make_cases(trace: Trace, capacity_blocks: int) -> list[Case]:
    classes = TrafficClasses()

    def sim(capacity: int | None, eviction: EvictionOrder) -> Callable[[], tuple[float, int]]:
        def run_once() -> tuple[float, int]:
            stats = simulate(trace, SimConfig(classes, capacity, eviction)).by_class[ALL]
            return stats.block_hit_ratio, stats.evicted_blocks

        return run_once

    return [
        (BASELINE, lambda: (dict_ttl_loop(trace, classes), 0)),
        ("sim-ttl", sim(None, EvictionOrder.EXPIRY)),
        ("sim-ttl-capacity-expiry", sim(capacity_blocks, EvictionOrder.EXPIRY)),
        ("sim-ttl-capacity-lru", sim(capacity_blocks, EvictionOrder.LRU)),
    ]


def dict_ttl_loop(trace: Trace, classes: TrafficClasses) -> float:
    """The yardstick: one dict of block -> expiry, TTL only; returns the block hit ratio."""
    ids, offsets = trace.block_ids, trace.block_offsets.tolist()
    times, class_ids = trace.time_s.tolist(), trace.class_ids.tolist()
    ttl_s = [classes.ttl_s(name) for name in trace.class_names]
    expires: dict[int, float] = {}
    hits = 0
    for r, now in enumerate(times):
        ttl = ttl_s[class_ids[r]]
        for b in ids[offsets[r] : offsets[r + 1]].tolist():
            e = expires.get(b)
            if e is not None and e > now:
                hits += 1
            expires[b] = now + ttl
    return hits / max(1, len(ids))


def measure(cases: list[Case], num_accesses: int, rounds: int) -> list[Record]:
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in cases}
    outcome: dict[str, tuple[float, int]] = {}
    for _ in range(rounds):
        for name, run_once in cases:
            cpu_start, wall_start = time.thread_time(), time.perf_counter()
            outcome[name] = run_once()
            cpu_s, wall_s = time.thread_time() - cpu_start, time.perf_counter() - wall_start
            passes[name].append((num_accesses / cpu_s, num_accesses / wall_s))
    records = [_record(name, passes[name], outcome[name], num_accesses) for name, _ in cases]
    baseline = records[0].accesses_per_s
    for record in records:
        record.vs_dict_baseline = record.accesses_per_s / baseline
        record.meets_target = record.accesses_per_s >= TARGET_ACCESSES_PER_S
    return records


def _record(
    name: str, passes: list[tuple[float, float]], outcome: tuple[float, int], num_accesses: int
) -> Record:
    cpu_rates = [cpu for cpu, _ in passes]
    median_cpu = statistics.median(cpu_rates)
    wall = statistics.median(w for _, w in passes)
    hit_ratio, evicted = outcome
    return Record(name, median_cpu, cpu_rates, wall, num_accesses, hit_ratio, evicted)


def print_table(records: list[Record], trace: Trace) -> None:
    table = Table(
        title=f"simulator speed: {trace.num_accesses:,} block accesses, "
        f"{trace.num_blocks:,} distinct blocks, {trace.num_requests:,} requests"
    )
    for column in ("case", "M accesses/s (CPU)", "M/s (wall)", "vs dict", "3M/s target"):
        table.add_column(column, justify="left" if column == "case" else "right")
    table.add_column("block hit", justify="right")
    table.add_column("evicted", justify="right")
    for r in records:
        table.add_row(
            r.case,
            f"{r.accesses_per_s / 1e6:.2f}",
            f"{r.wall_accesses_per_s / 1e6:.2f}",
            f"{r.vs_dict_baseline:.2f}x",
            "met" if r.meets_target else "missed",
            f"{100 * r.block_hit_ratio:.2f}%",
            f"{r.evicted_blocks:,}",
        )
    print_fitted(table)


def document(args: argparse.Namespace, trace: Trace, records: list[Record]) -> dict[str, Any]:
    return {
        "bench": "sim",
        "machine": {"python": platform.python_version(), "processor": platform.processor()},
        "workload": {
            "generator_days": args.days,
            "seed": args.seed,
            "requests": trace.num_requests,
            "block_accesses": trace.num_accesses,
            "distinct_blocks": trace.num_blocks,
            "capacity_share": args.capacity_share,
        },
        "rounds": args.rounds,
        "target_accesses_per_s": TARGET_ACCESSES_PER_S,
        "results": [asdict(r) for r in records],
    }
