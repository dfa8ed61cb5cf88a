"""``kvstore plan``: what a TTL x capacity setting costs in SSDs, nodes and bandwidth.

This shell lives in bench/, the top layer, because ``--model`` reads the engine's models.

::

    kvstore plan --sim out/sim.json --bytes-per-token 890 --json out/plan.json      # minimal
    kvstore plan --sim out/sim.parquet --bytes-per-token deepseek-v4.1-flash \\
        --tokens-per-day 155T --cluster DIR/cluster.toml --drive-size 15.36TB \\
        --drives-per-node 16 --usd-per-tb-month 10 --json out/plan.json --plot-dir out/plan
    kvstore plan --trace trace.jsonl --ttl chat=3d,7d --capacity 25%,inf \\
        --bytes-per-token 32x8x128xbf16 --json out/plan.json                       # sim + plan

The input is a ``kvstore sim`` result (JSON or Parquet) or a trace and grid (simulated first,
with every ``kvstore sim`` flag). The arithmetic is ``ttl.plan``'s; erasure k+m, read fanout,
expiry window and watermarks come from ``--cluster`` (cluster.toml) or the flags, which win.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from kvstore.cli.args import arg_type, duration_arg, size_arg
from kvstore.cli.sim import (
    DEFAULT_BYTES_PER_TOKEN,
    add_grid_arguments,
    add_output_arguments,
    add_trace_arguments,
    bytes_per_token_arg,
    simulate_from_args,
)
from kvstore.cli.tables import print_fitted
from kvstore.config import ClusterConfig, load_cluster
from kvstore.placement_weights import map_group_weights, node_weights, share_report
from ttl.cluster_fill import usable_fraction
from ttl.errors import TTLError
from ttl.plan import TierConfig, parse_count, plan_records, scale_for_tokens_per_day
from ttl.plan_report import plan_table, write_plan_plots
from ttl.report import write_json, write_parquet

_TIER_DEFAULTS = TierConfig()
count_arg = arg_type(parse_count, "count")


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore plan``."""
    source = parser.add_argument_group("input: a kvstore sim result, or a trace and a grid")
    source.add_argument("--sim", type=Path, help="a kvstore sim result: its JSON or Parquet")
    add_trace_arguments(parser, required=False)
    add_grid_arguments(parser, default_bytes_per_token=None)
    model = parser.add_argument_group("KV bytes per token (--bytes-per-token above)")
    model.add_argument(
        "--model",
        help="or the engine's own figure for a model it loads: default, random:1b, a .gguf "
        "file or a safetensors folder (needs the engine extra)",
    )
    model.add_argument(
        "--kv-dtype",
        default="bfloat16",
        help="stored KV format for --model: bfloat16, float16, float32 or e4m3x16 (FP8 with a "
        "bf16 scale per 16 values: 0.5625x bfloat16's bytes)",
    )
    tier = parser.add_argument_group("the tier (flags win over --cluster)")
    tier.add_argument("--cluster", type=Path, help="cluster.toml: k+m, read fanout, expiry "
                      "window, watermarks")  # fmt: skip
    tier.add_argument("--erasure", help=f"k+m (default: --cluster's, else "
                      f"{_TIER_DEFAULTS.data_shards}+{_TIER_DEFAULTS.parity_shards})")  # fmt: skip
    tier.add_argument("--expiry-window", type=duration_arg,
                      help=f"segment expiry window (default: --cluster's, else "
                      f"{_TIER_DEFAULTS.expiry_window_s:g} s)")  # fmt: skip
    tier.add_argument("--high-watermark", type=float,
                      help=f"evict above this share of a disk (default: --cluster's, else "
                      f"{_TIER_DEFAULTS.high_watermark})")  # fmt: skip
    tier.add_argument("--low-watermark", type=float,
                      help=f"evict down to this share (default: --cluster's, else "
                      f"{_TIER_DEFAULTS.low_watermark})")  # fmt: skip
    tier.add_argument("--drive-size", type=size_arg, default="15.36TB", help="bytes per drive")
    tier.add_argument("--drives-per-node", type=int, default=16, help="drives per storage node")
    tier.add_argument("--node-read-gb-per-s", type=float, default=40.0,
                      help="read GB/s one node serves (its NICs and drives)")  # fmt: skip
    tier.add_argument("--node-write-gb-per-s", type=float, default=20.0,
                      help="write GB/s one node absorbs")  # fmt: skip
    tier.add_argument("--usd-per-tb-month", type=float, help="price of a raw TB for a month")
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument(
        "--scale", type=float, default=1.0,
        help="run X independent copies of the trace's traffic: footprint, bandwidth and "
        "tokens saved scale by X, hit ratios do not",
    )  # fmt: skip
    traffic.add_argument(
        "--tokens-per-day", type=count_arg,
        help="or scale the trace to this many input tokens a day (155T)",
    )  # fmt: skip
    add_output_arguments(parser, "the plan as a Parquet table too")


def run(args: argparse.Namespace) -> int:
    try:
        planned, summary = plan_from_args(args)
    except (TTLError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"kvstore plan: error: {exc}", file=sys.stderr)
        return 2
    print_fitted(plan_table(planned), keep=("token hit", "raw TB", "nodes"))
    if args.json is not None:
        write_json({"inputs": summary, "results": planned}, args.json)
        print(f"wrote {args.json}")
    if args.parquet is not None:
        write_parquet(planned, args.parquet)
        print(f"wrote {args.parquet}")
    if args.plot_dir is not None:
        for path in write_plan_plots(planned, args.plot_dir, args.y_range):
            print(f"wrote {path}")
    return 0


def plan_from_args(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The planned records and what they were planned from."""
    records, source = _sim_records(args)
    if not records:
        raise ValueError(f"{source}: no simulation records to plan")
    bytes_per_token = _bytes_per_token(args, records)
    tier = tier_from_args(args)
    if args.tokens_per_day is not None:
        scale = scale_for_tokens_per_day(records, args.tokens_per_day)
    else:
        scale = args.scale
    planned = plan_records(records, bytes_per_token, tier, scale)
    summary = {
        "source": source,
        "bytes_per_token": bytes_per_token,
        "scale": scale,
        "tokens_per_day": args.tokens_per_day,
        "tier": dataclasses.asdict(tier),
    }
    return planned, summary


def _sim_records(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    if args.sim is None and args.trace is None:
        raise ValueError(
            "what to plan from: --sim PATH (a `kvstore sim --json` result, JSON or Parquet), or "
            "--trace PATH --format F with a grid (--ttl, --capacity) to simulate first; "
            "e.g. kvstore plan --sim out/sim.json --bytes-per-token 890 --json out/plan.json"
        )
    if args.sim is not None and args.trace is not None:
        raise ValueError("give --sim (a kvstore sim result) or --trace (and a grid), not both")
    if args.trace is not None:
        if args.bytes_per_token is None:
            args.bytes_per_token = bytes_per_token_arg(DEFAULT_BYTES_PER_TOKEN)
        _, records = simulate_from_args(args)
        return records, str(args.trace)
    path: Path = args.sim
    if not path.is_file():
        raise FileNotFoundError(f"no simulation result at {path}")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist(), str(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); give a kvstore sim --json result") from None
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        raise ValueError(f"{path}: expected kvstore sim's JSON, with a 'results' list")
    return document["results"], str(path)


def _bytes_per_token(args: argparse.Namespace, records: list[dict[str, Any]]) -> float:
    if args.model is not None:
        if args.bytes_per_token is not None and args.trace is None:
            raise ValueError("give --bytes-per-token or --model, not both")
        return model_kv_bytes_per_token(args.model, args.kv_dtype)
    if args.bytes_per_token is not None:
        return float(args.bytes_per_token)
    return float(records[0]["bytes_per_token"])


def model_kv_bytes_per_token(spec: str, dtype: str) -> float:
    """KV bytes per token of a model the engine loads (needs the engine extra: torch)."""
    try:
        from engine_adapter.loader import kv_bytes_per_token
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"--model needs the engine extra ({exc.name} is missing): pip install 'kvstore[engine]'"
        ) from None
    return kv_bytes_per_token(spec, dtype)


def tier_from_args(args: argparse.Namespace) -> TierConfig:
    """The tier: TierConfig's defaults, then ``--cluster``'s values, then the flags."""
    values: dict[str, Any] = {}
    if args.cluster is not None:
        cluster = load_cluster(args.cluster)
        node = cluster.nodes[0]
        values.update(
            data_shards=cluster.codec.k,
            parity_shards=cluster.codec.m,
            read_fanout=cluster.client.read_fanout,
            expiry_window_s=cluster.ttl.expiry_window_s,
            high_watermark=node.high_watermark,
            low_watermark=node.low_watermark,
            usable_fraction=_usable_fraction(cluster),
        )
    if args.erasure is not None:  # the client's default fanout for that code: k+1
        k, m = _k_plus_m(args.erasure)
        values.update(data_shards=k, parity_shards=m, read_fanout=k + min(1, m))
    flags = {
        "expiry_window_s": args.expiry_window,
        "high_watermark": args.high_watermark,
        "low_watermark": args.low_watermark,
        "usd_per_tb_month": args.usd_per_tb_month,
    }
    values.update({name: value for name, value in flags.items() if value is not None})
    return TierConfig(
        **values,
        drive_bytes=float(args.drive_size),
        drives_per_node=args.drives_per_node,
        node_read_bytes_per_s=args.node_read_gb_per_s * 1e9,
        node_write_bytes_per_s=args.node_write_gb_per_s * 1e9,
    )


def _usable_fraction(cluster: ClusterConfig) -> float:
    """What of the nodes' byte limits the map's placement fills before a node evicts (1.0
    without limits; kvstore/placement_weights.py weighs groups by them)."""
    if not any(n.max_bytes for n in cluster.nodes):
        return 1.0
    shares = share_report(cluster.nodes, cluster.groups, map_group_weights(cluster))
    node_bytes = node_weights(cluster.nodes)
    return min(1.0, usable_fraction(node_bytes, {n: s for n, (s, _) in shares.items()}))


def _k_plus_m(text: str) -> tuple[int, int]:
    k, sep, m = text.partition("+")
    if not sep or not k.strip().isdigit() or not m.strip().isdigit():
        raise ValueError(f"--erasure {text!r}: give k+m, e.g. 10+2")
    return int(k), int(m)
