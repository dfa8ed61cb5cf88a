"""``kvstore cluster status --dir DIR``: one Stats RPC per node, shown as two rich tables."""

from __future__ import annotations

from pathlib import Path

import grpc
from rich.console import Console
from rich.table import Table

from kvstore.config import ClusterConfig, NodeConfig, load_cluster
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub

STATS_TIMEOUT_S = 2.0


def fetch_stats(config: ClusterConfig) -> dict[str, pb.StatsReply | None]:
    """Node id -> its Stats reply (None if it did not answer); all nodes asked concurrently."""
    channels = {n.id: grpc.insecure_channel(n.address) for n in config.nodes}
    try:
        futures = {
            n.id: ShardStoreStub(channels[n.id]).Stats.future(
                pb.StatsRequest(), timeout=STATS_TIMEOUT_S, metadata=_auth(n)
            )
            for n in config.nodes
        }
        return {node_id: _result(future) for node_id, future in futures.items()}
    finally:
        for channel in channels.values():
            channel.close()


def _auth(node: NodeConfig) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {node.auth_token}"),) if node.auth_token else None


def _result(future: grpc.Future) -> pb.StatsReply | None:
    try:
        return future.result()
    except grpc.RpcError:
        return None


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def node_table(config: ClusterConfig, pids: dict[str, int], stats: dict) -> Table:
    table = Table(title=f"kvstore cluster, epoch {config.epoch}")
    for column in ("node", "address", "pid", "up", "shards", "bytes", "capacity", "corrupt"):
        table.add_column(column, justify="left" if column in ("node", "address") else "right")
    for node in config.nodes:
        reply = stats[node.id]
        pid = str(pids.get(node.id, "-"))
        if reply is None:
            table.add_row(node.id, node.address, pid, "[red]down[/red]", *["-"] * 4)
            continue
        capacity = human_bytes(reply.capacity_bytes) if reply.capacity_bytes else "-"
        table.add_row(
            node.id,
            node.address,
            pid,
            "[green]up[/green]",
            str(reply.shards),
            human_bytes(reply.bytes),
            capacity,
            str(reply.corrupt_shards),
        )
    return table


def class_table(stats: dict) -> Table:
    table = Table(title="per traffic class")
    columns = ("node", "class", "blocks", "bytes", "hits", "misses", "expired", "evicted")
    for column in (*columns, "youngest evicted age"):
        table.add_column(column, justify="left" if column in ("node", "class") else "right")
    for node_id, reply in stats.items():
        for c in reply.classes if reply is not None else ():
            age = "-" if c.youngest_evicted_age_s < 0 else f"{c.youngest_evicted_age_s:.0f} s"
            table.add_row(
                node_id,
                c.traffic_class,
                str(c.blocks),
                human_bytes(c.bytes),
                *(str(n) for n in (c.hits, c.misses, c.expired, c.evicted)),
                age,
            )
    return table


def print_status(root: Path, pids: dict[str, int]) -> int:
    """Print the tables; exit status 0 when every node answers, 1 otherwise."""
    config = load_cluster(root / "cluster.toml")
    stats = fetch_stats(config)
    console = Console()
    console.print(node_table(config, pids, stats))
    console.print(class_table(stats))
    return 0 if all(reply is not None for reply in stats.values()) else 1
