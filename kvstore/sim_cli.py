"""``kvstore sim`` and ``kvstore sim generate``: the shells over the ttl simulator.

Examples::

    kvstore sim --trace trace.jsonl --format mooncake --block-tokens 512 \\
        --ttl chat=1h,1d,7d --ttl agent=inf --capacity 10%,25%,inf --json out/sim.json \\
        --plot-dir out/plots
    kvstore sim generate --out out/ttl/workload14.jsonl --days 14 --seed 0

Semantics are in ``ttl.simulator``; grids and capacity forms in ``ttl.sweep``; formats in
``ttl.traces``; the workload generator in ``ttl.generate``. With ``--json`` the Parquet table
goes next to it unless ``--parquet`` says otherwise. ``kvstore sim replay`` (bench/replay.py)
replays a trace against a live cluster and takes the same trace options.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from kvstore.progress import ProgressReporter
from kvstore.tables import print_fitted
from ttl.errors import TTLError
from ttl.generate import WorkloadParams, write_workload
from ttl.policy import DEFAULT_EVICTION_ORDER, EvictionOrder
from ttl.report import records_table, write_json, write_parquet, write_plots
from ttl.sweep import grid_points, parse_capacities, parse_ttl_grid, result_records, run_grid
from ttl.traces import FORMATS, LoadOptions, Trace, load_trace, parse_type_map

log = logging.getLogger(__name__)

DEFAULT_BYTES_PER_TOKEN = 890.0  # DeepSeek V4.1-Flash global KV, about 890 bytes per token
PROGRESS_MIN_ACCESSES = 2_000_000  # smaller runs finish before a bar is worth drawing


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which trace to read and how (``sim`` and ``sim replay``)."""
    trace = parser.add_argument_group("trace")
    trace.add_argument("--trace", required=True, help="trace file, or a folder of session files")
    trace.add_argument("--format", choices=FORMATS, default="mooncake", help="(default mooncake)")
    trace.add_argument(
        "--block-tokens",
        type=int,
        help="tokens per hash id (default: mooncake 512, bailian 16, sessions: the file's)",
    )
    trace.add_argument(
        "--class",
        dest="default_class",
        default="chat",
        help="traffic class of records that name none (default chat)",
    )
    trace.add_argument(
        "--type-class",
        action="append",
        default=[],
        metavar="TYPE=CLASS",
        help="bailian: map a request type to a traffic class (repeatable)",
    )
    trace.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed records and count them instead of stopping at the first",
    )
    trace.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="stretch the gaps between requests by this factor (default 1)",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore sim``."""
    add_trace_arguments(parser)
    grid = parser.add_argument_group("policies (lists make a grid)")
    grid.add_argument(
        "--ttl",
        action="append",
        default=[],
        metavar="CLASS=DUR[,DUR...]",
        help="TTLs of a class, e.g. chat=7d or chat=1h,1d,7d; inf = no expiry "
        "(repeatable; default chat=7d, agent=3d)",
    )
    grid.add_argument(
        "--capacity",
        action="append",
        default=[],
        metavar="SPEC[,SPEC...]",
        help="capacities: share of distinct blocks (10%%), blocks (50000), bytes (2TiB) or "
        "inf (default inf)",
    )
    grid.add_argument(
        "--policy",
        default=DEFAULT_EVICTION_ORDER.value,
        help="eviction order(s) under capacity: lru, expiry, or expiry,lru "
        f"(default {DEFAULT_EVICTION_ORDER.value}, the store's default)",
    )
    grid.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="fraction of the trace's time span simulated but not counted (default 0)",
    )
    grid.add_argument(
        "--bytes-per-token",
        type=float,
        default=DEFAULT_BYTES_PER_TOKEN,
        help="KV bytes per token, for byte capacities and footprint "
        f"(default {DEFAULT_BYTES_PER_TOKEN:g})",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write results as JSON here")
    out.add_argument("--parquet", type=Path, help="Parquet table (default: next to --json)")
    out.add_argument("--plot-dir", type=Path, help="write hit-ratio plots (PNG) here")
    out.add_argument("--no-progress", action="store_true", help="no progress reports")


def run(args: argparse.Namespace) -> int:
    try:
        return _simulate(args, load_trace_from_args(args))
    except (TTLError, ValueError, FileNotFoundError) as exc:
        print(f"kvstore sim: error: {exc}", file=sys.stderr)
        return 2


def load_trace_from_args(args: argparse.Namespace) -> Trace:
    """The trace :func:`add_trace_arguments` describes, summarised on stdout."""
    options = LoadOptions(
        block_tokens=args.block_tokens,
        default_class=args.default_class,
        type_to_class=parse_type_map(args.type_class),
        skip_bad=args.skip_bad_lines,
    )
    trace = load_trace(args.trace, args.format, options)
    if args.time_scale != 1.0:
        trace = trace.with_time_scale(args.time_scale)
    print(describe_trace(trace))
    return trace


def describe_trace(trace: Trace) -> str:
    skipped = f"; skipped {trace.num_skipped} malformed records" if trace.num_skipped else ""
    return (
        f"trace: {trace.num_requests:,} requests, {trace.num_accesses:,} block accesses, "
        f"{trace.num_blocks:,} distinct blocks of {trace.block_tokens} tokens, "
        f"{trace.span_s / 86400:.3f} days, classes {', '.join(trace.class_names)}{skipped}"
    )


def _simulate(args: argparse.Namespace, trace: Trace) -> int:
    block_bytes = round(trace.block_tokens * args.bytes_per_token)
    points = grid_points(
        parse_ttl_grid(args.ttl, trace.class_names),
        parse_capacities(",".join(args.capacity or ["inf"]), trace.num_blocks, block_bytes),
        parse_policies(args.policy),
    )
    total = trace.num_accesses * len(points)
    enabled = not args.no_progress and total >= PROGRESS_MIN_ACCESSES
    with ProgressReporter("simulating block accesses", total, enabled=enabled) as progress:
        results = run_grid(trace, points, args.warmup, lambda done: progress.update(completed=done))
    records = [
        record
        for point, result in zip(points, results, strict=True)
        for record in result_records(point, result, trace.block_tokens, args.bytes_per_token)
    ]
    print_fitted(records_table(records), keep=("block hit", "token hit"))
    _write_outputs(args, trace, records)
    return 0


def parse_policies(text: str) -> list[EvictionOrder]:
    """``"expiry,lru"`` -> both eviction orders."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [order.value for order in EvictionOrder]
    if not names or any(name not in known for name in names):
        raise ValueError(f"--policy {text!r}: choose from {', '.join(known)}, comma-separated")
    return [EvictionOrder(name) for name in names]


def _write_outputs(args: argparse.Namespace, trace: Trace, records: list[dict[str, Any]]) -> None:
    if args.json is not None:
        write_json({"trace": trace_summary(args, trace), "results": records}, args.json)
        print(f"wrote {args.json}")
    parquet = args.parquet or (args.json.with_suffix(".parquet") if args.json else None)
    if parquet is not None:
        write_parquet(records, parquet)
        print(f"wrote {parquet}")
    if args.plot_dir is not None:
        for path in write_plots(records, args.plot_dir):
            print(f"wrote {path}")


def trace_summary(args: argparse.Namespace, trace: Trace) -> dict[str, Any]:
    return {
        "path": str(args.trace),
        "format": args.format,
        "requests": trace.num_requests,
        "block_accesses": trace.num_accesses,
        "distinct_blocks": trace.num_blocks,
        "block_tokens": trace.block_tokens,
        "span_s": trace.span_s,
        "time_scale": args.time_scale,
        "classes": list(trace.class_names),
        "skipped_records": trace.num_skipped,
    }


def configure_generate(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore sim generate``: one flag per WorkloadParams field."""
    parser.add_argument(
        "--out", type=Path, required=True, help="JSONL file to write (Mooncake format)"
    )
    for f in dataclasses.fields(WorkloadParams):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])


def run_generate(args: argparse.Namespace) -> int:
    params = WorkloadParams(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadParams)}
    )
    num_requests = write_workload(params, args.out)
    print(f"wrote {num_requests} requests over {params.days:g} days to {args.out}")
    return 0
