"""``kvstore cluster reweight``: move a live cluster map to capacity weights.

::

    kvstore cluster reweight (--dir DIR | --cluster PATH) [--max-bytes n20=512MiB,...]
                             [--fit budget|exact|slots] [--dry-run] [--keys 100000]

The weights are the nodes' byte limits (``max_bytes`` in the map; ``--max-bytes`` sets some
in the same change). The plan is kvstore/reweight.py's: slots handed over from nodes above
their weight to nodes below it, and group weights per ``--fit``. ``--dry-run`` prints, as
JSON, what the change would move (shards against the ideal, keys that change group, each
node's share against its weight) and changes nothing; without it the change is published
like a join or a drain (etcd's map, cluster.toml a copy): repair fills the new slots and the
keeper finishes the move (``kvstore cluster status``). A static map (no etcd) has no move
machinery, so only ``--dry-run`` reads it. Errors are printed, with exit status 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from deploy.cluster_cli import add_cluster_location, existing_map, report_errors
from deploy.local_cluster import LocalCluster
from kvstore.cli.args import list_arg
from kvstore.config import ClusterConfig, load_cluster
from kvstore.errors import InvalidArgument
from kvstore.reweight import FITS, move_report, reweight
from ttl.units import parse_size_bytes


def configure_reweight(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster reweight``."""
    add_cluster_location(parser)
    parser.add_argument(
        "--max-bytes",
        type=list_arg(_node_limit),
        default=[],
        help="new byte limits set in the same change, e.g. n20=512MiB,n21=512MiB (others "
        "keep the map's)",
    )
    parser.add_argument(
        "--fit",
        choices=FITS,
        default="budget",
        help="budget: no more shards moved than the weights require, the residual corrected "
        "as far as that allows; exact: shares at the weights (about 1.3x the shards); "
        "slots: groups kept equal",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would move, as JSON; change nothing"
    )
    parser.add_argument(
        "--keys", type=int, default=100_000, help="random keys the figures are counted over"
    )


def _node_limit(text: str) -> tuple[str, int]:
    node_id, sep, size = text.partition("=")
    if not sep or not node_id.strip():
        raise ValueError(f"a limit is NODE=SIZE like n20=512MiB, got {text!r}")
    return node_id.strip(), parse_size_bytes(size.strip())


def run_reweight(args: argparse.Namespace) -> int:
    return report_errors(_reweight, args)


def _reweight(args: argparse.Namespace) -> int:
    cluster_toml = args.cluster or args.dir / "cluster.toml"
    cluster = LocalCluster(cluster_toml.parent, load_cluster(existing_map(cluster_toml)))
    limits = dict(args.max_bytes)
    if len(limits) != len(args.max_bytes):
        raise InvalidArgument(f"--max-bytes names a node twice: {args.max_bytes}")
    if args.keys < 1:
        raise InvalidArgument(f"--keys must be at least 1, got {args.keys}")
    before = cluster.current_map()
    planned = reweight(before, limits, args.fit)  # checks the request before any change
    if args.dry_run:
        print(json.dumps({"fit": args.fit, **move_report(before, planned, args.keys)}, indent=2))
        return 0
    if not before.membership.endpoints:
        raise InvalidArgument(
            f"{cluster_toml} is a static map (no etcd membership): nothing would move the "
            "shards of the slots it hands over, so reweight only reads it (--dry-run); start "
            "the cluster with `kvstore cluster up --etcd` to change its map live"
        )
    after = cluster.change_map(lambda current: reweight(current, limits, args.fit))
    _print_applied(before, after, move_report(before, after, args.keys))
    return 0


def _print_applied(before: ClusterConfig, after: ClusterConfig, report: dict[str, Any]) -> None:
    print(
        f"map epoch {before.epoch} -> {after.epoch}: {report['slots_moved']} of "
        f"{report['slots']} group slots move ({report['ratio_to_ideal']:.3f} of the shards the "
        f"weights require); {report['keys_regrouped']} of {report['keys']} sampled keys change "
        "group and read as misses until written again; the worst node holds "
        f"{report['worst_share_over_weight']:.3f} of its weight's share. Repair fills the "
        "slots and the keeper finishes the move (`kvstore cluster status`); a node enforces "
        "a new max_bytes from its next start"
    )
