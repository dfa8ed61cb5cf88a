"""Replay a trace against a live cluster through the real client, next to the simulation.

``kvstore sim replay --trace PATH --cluster DIR/cluster.toml --block-bytes N`` (every trace
option of ``kvstore sim`` works here too). Requests go out one
at a time in trace order, each at its virtual time: trace offsets are laid onto the cluster's
clock (``ttl.clock.make_clock(time_scale, origin_unix_s)`` from ``cluster.toml``), starting a
moment after the replay begins. For each request, like an engine's prefill worker:

1. ``match_prefix(keys)``: the measured prefix hit (an existence check: it refreshes nothing);
2. ``get`` every hit block (a read hit refreshes its TTL, as a swap-in does) and check that the
   bytes are exactly the payload that was put;
3. ``put`` every block after the hit with the request's traffic class (the engine recomputed
   them; a write refreshes a block that was still there after the first miss).

Keys are ``xxh3_128(run namespace, dense block id)``. Dense ids already name a block together
with its prefix (``ttl.traces``), and a fresh namespace per run keeps runs apart. Payloads are
``N`` bytes derived from the key. The simulated side is ``ttl.simulator`` on the same trace
with the cluster's TTL classes and no capacity limit (node byte limits are not modelled).
A request that finishes late shifts the next ones: ``max_lag_s`` reports the worst lag in
virtual seconds, so a TTL edge closer than that to a reuse can flip a hit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from rich.table import Table

from client import KVClient
from kvstore.cli.sim import add_trace_arguments, load_trace_from_args
from kvstore.cli.tables import print_fitted
from kvstore.config import load_cluster
from kvstore.errors import ERRORS, ChecksumMismatch
from ttl.clock import make_clock
from ttl.report import write_json
from ttl.simulator import ALL, SimConfig, SimResult, simulate
from ttl.traces import Trace

log = logging.getLogger(__name__)

START_LEAD_REAL_S = 0.2  # real seconds between starting the replay and its first request


@dataclass
class ReplayStats:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    tokens_saved: int = 0

    @property
    def block_hit_ratio(self) -> float | None:
        return self.hit_blocks / self.blocks if self.blocks else None

    @property
    def token_hit_ratio(self) -> float | None:
        return self.tokens_saved / self.tokens if self.tokens else None


@dataclass
class ReplayResult:
    by_class: dict[str, ReplayStats] = field(default_factory=dict)  # every class, and ALL
    max_lag_s: float = 0.0  # worst lateness of a request against its virtual time
    num_vanished: int = 0  # hits that a get then missed (expired or evicted in between)


def block_key(namespace: bytes, block_id: int) -> bytes:
    """The 16-byte store key of a dense block id within one replay run."""
    return xxhash.xxh3_128_digest(namespace + block_id.to_bytes(8, "little"))


def block_payload(key: bytes, block_bytes: int) -> bytes:
    """``block_bytes`` bytes derived from the key, so every get can be checked."""
    return (key * (block_bytes // len(key) + 1))[:block_bytes]


async def replay(
    trace: Trace,
    cluster_toml: str | Path,
    block_bytes: int,
    tenant: str = "sim",
    token: str | None = None,
) -> ReplayResult:
    """Send the trace's lookups, reads and writes to the cluster; measure the prefix hits."""
    config = await asyncio.to_thread(load_cluster, cluster_toml)
    clock = make_clock(config.ttl.time_scale, config.ttl.origin_unix_s)
    namespace = f"kvstore-sim-replay/{os.urandom(8).hex()}/".encode()
    result = ReplayResult({name: ReplayStats() for name in (*trace.class_names, ALL)})
    scale = config.ttl.time_scale
    start_s = clock.now() + START_LEAD_REAL_S * scale
    async with KVClient.connect(config, tenant=tenant, token=token) as kv:
        for r in range(trace.num_requests):
            due_s = start_s + float(trace.time_s[r] - trace.time_s[0])
            await asyncio.sleep(max(0.0, (due_s - clock.now()) / scale))
            result.max_lag_s = max(result.max_lag_s, clock.now() - due_s)
            await _replay_request(kv, trace, r, namespace, block_bytes, result)
    return result


async def _replay_request(
    kv: KVClient, trace: Trace, r: int, namespace: bytes, block_bytes: int, result: ReplayResult
) -> None:
    keys = [block_key(namespace, b) for b in trace.blocks(r).tolist()]
    traffic_class = trace.class_names[trace.class_ids[r]]
    num_hit = await kv.match_prefix(keys)
    blocks = await asyncio.gather(*(kv.get(key) for key in keys[:num_hit]))
    for key, block in zip(keys[:num_hit], blocks, strict=True):
        if block is None:
            result.num_vanished += 1
        elif block != block_payload(key, block_bytes):
            raise ChecksumMismatch(f"replay: get returned wrong bytes for key {key.hex()}")
    await asyncio.gather(
        *(kv.put(k, block_payload(k, block_bytes), traffic_class) for k in keys[num_hit:])
    )
    input_tokens = int(trace.input_tokens[r])
    for stats in (result.by_class[traffic_class], result.by_class[ALL]):
        stats.requests += 1
        stats.blocks += len(keys)
        stats.hit_blocks += num_hit
        stats.tokens += min(len(keys) * trace.block_tokens, input_tokens)
        stats.tokens_saved += min(num_hit * trace.block_tokens, input_tokens)


def simulate_for_cluster(trace: Trace, cluster_toml: str | Path) -> SimResult:
    """The simulation a replay is compared with: the cluster's TTLs, no capacity limit."""
    return simulate(trace, SimConfig(load_cluster(cluster_toml).ttl.classes))


def comparison_records(simulated: SimResult, measured: ReplayResult) -> list[dict[str, Any]]:
    """Per class and ``all``: simulated and measured hit ratios side by side."""
    records = []
    for name, got in measured.by_class.items():
        want = simulated.by_class[name]
        records.append(
            {
                "traffic_class": name,
                "requests": got.requests,
                "blocks": got.blocks,
                "simulated_hit_blocks": want.hit_blocks,
                "measured_hit_blocks": got.hit_blocks,
                "simulated_block_hit_ratio": _none_if_nan(want.block_hit_ratio),
                "measured_block_hit_ratio": got.block_hit_ratio,
                "simulated_token_hit_ratio": _none_if_nan(want.token_hit_ratio),
                "measured_token_hit_ratio": got.token_hit_ratio,
            }
        )
    return records


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore sim replay``."""
    add_trace_arguments(parser)
    replay = parser.add_argument_group("the cluster")
    replay.add_argument(
        "--cluster", type=Path, required=True, help="DIR/cluster.toml to replay into"
    )
    replay.add_argument("--block-bytes", type=int, default=4096, help="payload bytes per block")
    replay.add_argument("--tenant", default="sim", help="tenant the replay writes as")
    replay.add_argument("--token", default=None, help="auth token for the cluster, if any")
    replay.add_argument("--json", type=Path, help="write the comparison as JSON here")


def run(args: argparse.Namespace) -> int:
    """Simulate, replay, print both side by side, optionally write JSON."""
    try:
        return _replay_and_compare(args, load_trace_from_args(args))
    except (*ERRORS, FileNotFoundError) as exc:
        print(f"kvstore sim replay: error: {exc}", file=sys.stderr)
        return 2


def _replay_and_compare(args: argparse.Namespace, trace: Trace) -> int:
    simulated = simulate_for_cluster(trace, args.cluster)
    measured = asyncio.run(replay(trace, args.cluster, args.block_bytes, args.tenant, args.token))
    records = comparison_records(simulated, measured)
    _print_comparison(records, measured)
    if args.json is not None:
        document = {
            "cluster": str(args.cluster),
            "block_bytes": args.block_bytes,
            "max_lag_s": measured.max_lag_s,
            "vanished_hits": measured.num_vanished,
            "results": records,
        }
        write_json(document, args.json)
        print(f"wrote {args.json}")
    return 0


def _print_comparison(records: list[dict[str, Any]], measured: ReplayResult) -> None:
    table = Table(title="replay: simulated vs measured on the cluster")
    for column in ("class", "requests", "blocks", "sim block hit", "cluster block hit"):
        table.add_column(column, justify="left" if column == "class" else "right")
    table.add_column("sim token hit", justify="right")
    table.add_column("cluster token hit", justify="right")
    for r in records:
        table.add_row(
            r["traffic_class"],
            f"{r['requests']:,}",
            f"{r['blocks']:,}",
            _percent(r["simulated_block_hit_ratio"]),
            _percent(r["measured_block_hit_ratio"]),
            _percent(r["simulated_token_hit_ratio"]),
            _percent(r["measured_token_hit_ratio"]),
        )
    print_fitted(table)
    print(
        f"worst lag behind the trace: {measured.max_lag_s:,.0f} virtual s; "
        f"hits gone before their get: {measured.num_vanished}"
    )


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100.0 * ratio:.2f}%"
