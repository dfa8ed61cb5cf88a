"""``kvstore sim`` and ``kvstore sim generate``: the shells over the ttl simulator.

Examples::

    kvstore sim --trace trace.jsonl --format mooncake --block-tokens 512 \\
        --ttl chat=1h,1d,7d --ttl agent=inf --capacity 10%,25%,inf --json out/sim.json \\
        --plot-dir out/plots
    kvstore sim generate --out out/ttl/workload14.jsonl --days 14 --seed 0

    kvstore sim --trace big.jsonl --partitions 12 --ray local --workers 8 --json out/sim.json

Semantics are in ``ttl.simulator``; grids and capacity forms in ``ttl.sweep``; formats in
``ttl.traces``; the workload generator in ``ttl.generate``; partitions in ``ttl.partition``
and ``kvstore.cli.sim_partitions``. With ``--json`` the Parquet table goes next to it unless
``--parquet`` says otherwise. ``kvstore sim replay`` (bench/replay.py) replays a trace against
a live cluster and takes the same trace options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.cli.args import arg_type, duration_arg, size_arg
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.sim_partitions import INLINE, LOCAL, make_executor, placement_partitions
from kvstore.cli.tables import print_fitted
from ttl.errors import TTLError
from ttl.generate import WorkloadParams, write_session_files, write_workload
from ttl.partition import PartitionedTrace, simulate_partitioned, split_trace
from ttl.plan import MODEL_PRESETS, parse_bytes_per_token
from ttl.policy import DEFAULT_EVICTION_ORDER, EvictionOrder
from ttl.report import FULL_RANGE, records_table, write_json, write_parquet, write_plots
from ttl.simulator import DEFAULT_RATE_WINDOW_S, SimResult, sim_result
from ttl.sweep import (
    GridPoint,
    grid_points,
    parse_capacities,
    parse_ttl_grid,
    point_config,
    result_records,
    run_grid,
)
from ttl.traces import (
    FORMATS,
    MOONCAKE,
    PARTIAL_BLOCKS,
    PARTIAL_DROP,
    SESSIONS,
    LoadOptions,
    Trace,
    load_trace,
    parse_type_map,
    trace_units,
)

log = logging.getLogger(__name__)

DEFAULT_BYTES_PER_TOKEN = "deepseek-v4.1-flash"  # DeepSeek V4.1-Flash global KV: 890 B/token
PROGRESS_MIN_ACCESSES = 2_000_000  # smaller runs finish before a bar is worth drawing
BYTES_PER_TOKEN_HELP = (
    "KV bytes per token: a number (890), a model preset ("
    + ", ".join(f"{name} = {value:g}" for name, value in MODEL_PRESETS.items())
    + ") or a Llama-style layout LAYERSxKV_HEADSxHEAD_DIMxDTYPE (32x8x128xbf16 = 2 x layers x "
    "KV heads x head dim x dtype bytes)"
)
bytes_per_token_arg = arg_type(parse_bytes_per_token, "bytes per token")


def _percent_range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(",")
    try:
        bounds = (float(low), float(high))
    except ValueError:
        bounds = (1.0, 0.0)
    if not sep or not 0.0 <= bounds[0] < bounds[1] <= 100.0:
        raise ValueError(f"--y-range {text!r}: give LO,HI in percent, 0 <= LO < HI <= 100")
    return bounds


y_range_arg = arg_type(_percent_range, "percent range")


def add_plot_arguments(group: argparse._ArgumentGroup) -> None:
    """``--plot-dir`` and ``--y-range`` (``sim`` and ``plan``)."""
    group.add_argument("--plot-dir", type=Path, help="write hit-ratio plots (PNG) here")
    group.add_argument(
        "--y-range",
        type=y_range_arg,
        default=FULL_RANGE,
        metavar="LO,HI",
        help="hit-ratio axis of the plots, in percent: the same range across plots; "
        "narrower only on purpose",
    )


def add_trace_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The options that say which trace to read and how (``sim``, ``sim replay``, ``plan``)."""
    trace = parser.add_argument_group("trace")
    trace.add_argument(
        "--trace", required=required, help="trace file, or a folder of session files"
    )
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
    trace.add_argument(
        "--partial-blocks",
        choices=PARTIAL_BLOCKS,
        default=PARTIAL_DROP,
        help="a request's trailing partial block: drop (what the store and the engine cache: "
        "full blocks only) or count (as published trace figures count it)",
    )


def add_grid_arguments(
    parser: argparse.ArgumentParser, default_bytes_per_token: str | None = DEFAULT_BYTES_PER_TOKEN
) -> None:
    """The TTL x capacity x policy grid (``sim`` and ``plan --trace``)."""

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
    add_sizing_arguments(grid, default_bytes_per_token)
    add_partition_arguments(parser)


def add_sizing_arguments(
    grid: argparse._ArgumentGroup, default_bytes_per_token: str | None
) -> None:
    """What turns blocks into bytes and rates: ``--bytes-per-token``, ``--rate-window``."""
    grid.add_argument(
        "--bytes-per-token",
        type=bytes_per_token_arg,
        default=default_bytes_per_token,
        help=BYTES_PER_TOKEN_HELP
        + (
            "; for byte capacities and footprints"
            if default_bytes_per_token
            else " (default: the simulation's own; with --trace, deepseek-v4.1-flash)"
        ),
    )
    grid.add_argument(
        "--rate-window",
        type=duration_arg,
        default=DEFAULT_RATE_WINDOW_S,
        help="peak read and write rates are the busiest window of this length (seconds, or "
        "1h, 5m): the busy hour by default",
    )


def add_partition_arguments(parser: argparse.ArgumentParser) -> None:
    """Partitions of the simulation over Ray (``--partitions``, ``--ray``, ``--workers``)."""
    scale = parser.add_argument_group("past one machine")
    scale.add_argument(
        "--partitions",
        type=int,
        default=0,
        help="split the blocks over P placement groups by the store's placement hash, each "
        "with capacity/P, simulated as independent Ray tasks (the cluster's answer); "
        "0 = one process, one cache",
    )
    scale.add_argument(
        "--ray",
        default=LOCAL,
        metavar="ADDRESS",
        help=f"with --partitions: {LOCAL!r} (ray.init() on this machine), an existing "
        f"cluster's address (e.g. ray://head:10001), or {INLINE!r} (tasks in this process)",
    )
    scale.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="CPUs of a local Ray (this machine's)",
    )
    scale.add_argument(
        "--unit-bytes",
        type=size_arg,
        default="64MiB",
        help="trace bytes (or session-file bytes) one loading task parses",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore sim``."""
    add_trace_arguments(parser)
    add_grid_arguments(parser)
    add_output_arguments(parser, "Parquet table (default: next to --json)")


def add_output_arguments(parser: argparse.ArgumentParser, parquet_help: str) -> None:
    """``--json``, ``--parquet``, the plot flags and ``--no-progress`` (``sim`` and ``plan``)."""
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write the results as JSON here")
    out.add_argument("--parquet", type=Path, help=parquet_help)
    add_plot_arguments(out)
    out.add_argument("--no-progress", action="store_true", help="no progress reports")


def run(args: argparse.Namespace) -> int:
    try:
        summary, records = simulate_from_args(args)
    except (TTLError, ValueError, FileNotFoundError) as exc:
        print(f"kvstore sim: error: {exc}", file=sys.stderr)
        return 2
    print_fitted(records_table(records), keep=("block hit", "token hit"))
    _write_outputs(args, summary, records)
    return 0


def simulate_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The trace summary and the result records of the grid ``args`` describe (``sim`` and
    ``plan --trace``), in one process or over ``--partitions``."""
    if args.partitions < 0:
        raise ValueError(f"--partitions must be >= 0, got {args.partitions}")
    if args.partitions:
        return _simulate_partitioned(args)
    trace = load_trace_from_args(args)
    summary = trace_summary(args, trace)
    points = _grid(args, trace.class_names, trace.num_blocks, trace.block_tokens)
    total = trace.num_accesses * len(points)
    enabled = not args.no_progress and total >= PROGRESS_MIN_ACCESSES
    with ProgressReporter("simulating block accesses", total, enabled=enabled) as progress:
        results = run_grid(
            trace, points, args.warmup, lambda done: progress.update(completed=done),
            args.rate_window,
        )  # fmt: skip
    return summary, _records(args, points, results, trace.block_tokens)


def _simulate_partitioned(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    executor = make_executor(args.ray, args.workers)
    try:
        units = trace_units(args.trace, args.format, args.unit_bytes)
        with contextlib.ExitStack() as steps:
            split = split_trace(
                units, args.format, load_options(args), args.partitions, placement_partitions,
                executor, args.time_scale, step_progress(steps, not args.no_progress),
            )  # fmt: skip
        requests = split.requests
        summary = trace_summary(args, requests, split)
        print(describe_trace(summary))
        points = _grid(args, requests.class_names, split.num_blocks, requests.block_tokens)
        configs = [point_config(point, args.warmup, args.rate_window) for point in points]
        total = len(configs) * args.partitions
        with ProgressReporter("simulating partitions", total, enabled=not args.no_progress) as bar:
            counts = simulate_partitioned(
                split, configs, executor, lambda done: bar.update(completed=done)
            )
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    results = [sim_result(requests, c, n) for c, n in zip(configs, counts, strict=True)]
    return summary, _records(args, points, results, requests.block_tokens)


def step_progress(stack: contextlib.ExitStack, enabled: bool) -> Callable[[str, int, int], None]:
    """A progress callback for steps of tasks: one reporter per step, opened on its first
    report and closed with ``stack`` (a line every interval while a step runs past it)."""
    reporters: dict[str, ProgressReporter] = {}

    def report(step: str, done: int, total: int) -> None:
        if step not in reporters:
            reporter = ProgressReporter(step, total, enabled=enabled)
            reporters[step] = stack.enter_context(reporter)
        reporters[step].update(completed=done)

    return report


def _grid(
    args: argparse.Namespace, class_names: tuple[str, ...], num_blocks: int, block_tokens: int
) -> list[GridPoint]:
    block_bytes = round(block_tokens * args.bytes_per_token)
    return grid_points(
        parse_ttl_grid(args.ttl, class_names),
        parse_capacities(",".join(args.capacity or ["inf"]), num_blocks, block_bytes),
        parse_policies(args.policy),
    )


def _records(
    args: argparse.Namespace,
    points: list[GridPoint],
    results: list[SimResult],
    block_tokens: int,
) -> list[dict[str, Any]]:
    return [
        record
        for point, result in zip(points, results, strict=True)
        for record in result_records(point, result, block_tokens, args.bytes_per_token)
    ]


def load_options(args: argparse.Namespace) -> LoadOptions:
    """How to read the trace, from :func:`add_trace_arguments`' flags."""
    return LoadOptions(
        block_tokens=args.block_tokens,
        default_class=args.default_class,
        type_to_class=parse_type_map(args.type_class),
        skip_bad=args.skip_bad_lines,
        partial_blocks=args.partial_blocks,
    )


def load_trace_from_args(args: argparse.Namespace) -> Trace:
    """The trace :func:`add_trace_arguments` describes, summarised on stdout."""
    with contextlib.ExitStack() as steps:
        report = step_progress(steps, not getattr(args, "no_progress", False))
        trace = load_trace(
            args.trace, args.format, load_options(args),
            lambda done, total: report("loading the trace (bytes)", done, total),
        )  # fmt: skip
    if args.time_scale != 1.0:
        trace = trace.with_time_scale(args.time_scale)
    print(describe_trace(trace_summary(args, trace)))
    return trace


def describe_trace(summary: dict[str, Any]) -> str:
    """One line about the trace (:func:`trace_summary`'s figures)."""
    skipped = summary["skipped_records"]
    skipped_text = f"; skipped {skipped} malformed records" if skipped else ""
    partitions = summary["partitions"]
    split = f", over {partitions} partitions" if partitions else ""
    return (
        f"trace: {summary['requests']:,} requests, {summary['block_accesses']:,} block "
        f"accesses, {summary['distinct_blocks']:,} distinct blocks of "
        f"{summary['block_tokens']} tokens ({summary['partial_blocks']} partial blocks), "
        f"{summary['span_s'] / 86400:.3f} days, classes {', '.join(summary['classes'])}"
        f"{split}{skipped_text}"
    )


def parse_policies(text: str) -> list[EvictionOrder]:
    """``"expiry,lru"`` -> both eviction orders."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [order.value for order in EvictionOrder]
    if not names or any(name not in known for name in names):
        raise ValueError(f"--policy {text!r}: choose from {', '.join(known)}, comma-separated")
    return [EvictionOrder(name) for name in names]


def _write_outputs(
    args: argparse.Namespace, summary: dict[str, Any], records: list[dict[str, Any]]
) -> None:
    if args.json is not None:
        write_json({"trace": summary, "results": records}, args.json)
        print(f"wrote {args.json}")
    parquet = args.parquet or (args.json.with_suffix(".parquet") if args.json else None)
    if parquet is not None:
        write_parquet(records, parquet)
        print(f"wrote {parquet}")
    if args.plot_dir is not None:
        for path in write_plots(records, args.plot_dir, args.y_range):
            print(f"wrote {path}")


def trace_summary(
    args: argparse.Namespace, trace: Trace, split: PartitionedTrace | None = None
) -> dict[str, Any]:
    """The trace's figures for the JSON (``split``: the partitions' totals)."""
    return {
        "path": str(args.trace),
        "format": args.format,
        "requests": trace.num_requests,
        "block_accesses": trace.num_accesses if split is None else split.num_accesses,
        "distinct_blocks": trace.num_blocks if split is None else split.num_blocks,
        "block_tokens": trace.block_tokens,
        "partial_blocks": args.partial_blocks,
        "span_s": trace.span_s,
        "time_scale": args.time_scale,
        "classes": list(trace.class_names),
        "skipped_records": trace.num_skipped,
        "partitions": 0 if split is None else len(split.partitions),
    }


def configure_generate(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore sim generate``: one flag per WorkloadParams field."""
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="where to write: a JSONL file (mooncake) or a folder (sessions); missing parent "
        "folders are made",
    )
    parser.add_argument(
        "--format",
        choices=(MOONCAKE, SESSIONS),
        default=MOONCAKE,
        help="mooncake: one JSONL file; sessions: one JSON per conversation (ids local to a "
        "file, so system prompts are not shared across sessions)",
    )
    for f in dataclasses.fields(WorkloadParams):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])


def run_generate(args: argparse.Namespace) -> int:
    params = WorkloadParams(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadParams)}
    )
    write = write_session_files if args.format == SESSIONS else write_workload
    with contextlib.ExitStack() as steps:
        report = step_progress(steps, enabled=True)
        num_requests = write(
            params, args.out, lambda done, total: report("generating sessions", done, total)
        )
    print(f"wrote {num_requests} requests over {params.days:g} days to {args.out}")
    return 0
