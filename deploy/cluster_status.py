"""``kvstore cluster status --dir DIR [--json [PATH]]``: one Stats RPC per node, as tables or JSON.

The JSON (``--json``)::

    {"cluster_toml": ..., "epoch": 1, "tls": true, "auth": true,
     "membership": "static" or the etcd endpoint, "moving": false,
     "capacity_bytes": ...,      # shared filesystems counted once
     "filesystems": {"host:dev": {"bytes", "nodes", "capacity_bytes"}},
     "repair_backlog_shards": 0,
     "retention_caps": [{"tenant", "traffic_class", "max_ttl_s"}],
     "nodes": [{"id", "address", "failure_domain", "state", "registered", "pid", "up",
                "epoch", "filesystem_id", "shards", "bytes",
                "placement_share", "weight_share",  # of all shards placed; of the byte limits
                "used_bytes", "index_bytes", "capacity_bytes", "quarantined_bytes",
                "corrupt_shards", "segments", "hits", "misses", "retired_versions",
                "last_tombstone_seq",
                "repair": {"backlog_shards", "rebuilt_shards", "rebuilt_bytes", "read_bytes",
                           "skipped_expiring", "unrecoverable", "fenced", "queued_hints",
                           "passes", "led_groups"},
                "classes": [{"traffic_class", "shards", "bytes", "hits", "misses",
                             "expired", "evicted", "youngest_evicted_age_s"}]}]}

A node that does not answer (or refuses the credential) has ``"up": false`` and no figures.
``repair_backlog_shards`` is the sum of every answering node's repair backlog: the shards its
led groups are known to miss (kvstore/node/repair_service.py); 0 once repair has caught up.
Stats needs an admin credential when the nodes require auth: the token `cluster up --auth`
wrote in DIR/admin.token, else ``$KVSTORE_TOKEN`` / ``$KVSTORE_TOKEN_FILE``. The retention
caps are the nodes' own (from their credentials file), as the first node that answered
reports them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from rich.table import Table

from kvstore.auth import client_token
from kvstore.cli.tables import make_console, print_fitted
from kvstore.config import ClusterConfig, NodeConfig, load_cluster
from kvstore.errors import Unavailable
from kvstore.map_cache import fallback_map, save_cached_map
from kvstore.membership import EtcdMembership
from kvstore.placement_weights import map_group_weights, share_report
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import channel_credentials, sync_channel
from ttl.units import format_bytes, format_duration

STATS_TIMEOUT_S = 2.0
ETCD_TIMEOUT_S = 3.0  # then status reports from the cached map and says etcd is unreachable


def fetch_stats(
    config: ClusterConfig,
    token: str | None = None,
    client_cert: tuple[str | None, str | None] = (None, None),
) -> dict[str, pb.StatsReply | None]:
    """Node id -> its Stats reply (None if it did not answer); all nodes asked concurrently."""
    credentials = channel_credentials(config, *client_cert)
    channels = {n.id: sync_channel(n.address, credentials, node_id=n.id) for n in config.nodes}
    token = client_token(token)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        futures = {
            n.id: ShardStoreStub(channels[n.id]).Stats.future(
                pb.StatsRequest(), timeout=STATS_TIMEOUT_S, metadata=metadata
            )
            for n in config.nodes
        }
        return {node_id: _result(future) for node_id, future in futures.items()}
    finally:
        for channel in channels.values():
            channel.close()


def _result(future: grpc.Future) -> pb.StatsReply | None:
    try:
        return future.result()
    except grpc.RpcError:
        return None


def node_table(config: ClusterConfig, pids: dict[str, int], stats: dict) -> Table:
    moving = ", moving shards" if config.moving_from else ""
    capacity = format_bytes(cluster_capacity_bytes(stats))
    table = Table(title=f"kvstore cluster, map epoch {config.epoch}{moving}; capacity {capacity}")
    columns = ("node", "address", "state", "pid", "up", "share/weight", "shards", "bytes")
    for column in (*columns, "capacity", "corrupt", "backlog"):
        table.add_column(column, justify="left" if column in ("node", "address") else "right")
    shares = share_report(config.nodes, config.groups, map_group_weights(config))
    for node in config.nodes:
        reply = stats[node.id]
        pid = str(node_pid(node.id, pids, reply) or "-")
        share, weight = shares[node.id]
        placed = f"{100 * share:.1f}%/{100 * weight:.1f}%"
        if reply is None:
            table.add_row(
                node.id, node.address, node.state, pid, "[red]down[/red]", placed, *["-"] * 5
            )
            continue
        capacity = format_bytes(reply.capacity_bytes) if reply.capacity_bytes else "-"
        table.add_row(
            node.id,
            node.address,
            node.state,
            pid,
            "[green]up[/green]",
            placed,
            str(reply.shards),
            format_bytes(reply.bytes),
            capacity,
            str(reply.corrupt_shards),
            str(reply.repair.backlog_shards),
        )
    return table


def class_table(stats: dict) -> Table:
    table = Table(title="per traffic class")
    columns = ("node", "class", "shards", "bytes", "hits", "misses", "expired", "evicted")
    for column in (*columns, "youngest evicted age"):
        table.add_column(column, justify="left" if column in ("node", "class") else "right")
    for node_id, reply in stats.items():
        for c in reply.classes if reply is not None else ():
            age = f"{c.youngest_evicted_age_s:.0f} s" if _youngest(c) is not None else "-"
            table.add_row(
                node_id,
                c.traffic_class,
                str(c.blocks),
                format_bytes(c.bytes),
                *(str(n) for n in (c.hits, c.misses, c.expired, c.evicted)),
                age,
            )
    return table


def retention_caps(stats: dict) -> list[dict[str, Any]]:
    """The tenant TTL caps in force, as the first node that answered reports them."""
    reply = next((r for r in stats.values() if r is not None), None)
    caps = reply.retention_caps if reply is not None else ()
    return [
        {"tenant": c.tenant, "traffic_class": c.traffic_class, "max_ttl_s": c.max_ttl_s}
        for c in caps
    ]


def caps_table(caps: list[dict[str, Any]]) -> Table:
    table = Table(title="retention caps (tenant TTL per class, enforced by the nodes)")
    for column in ("tenant", "class", "max TTL"):
        table.add_column(column, justify="right" if column == "max TTL" else "left")
    for cap in caps:
        table.add_row(cap["tenant"], cap["traffic_class"], format_duration(cap["max_ttl_s"]))
    return table


def node_pid(node_id: str, pids: dict[str, int], reply: pb.StatsReply | None) -> int | None:
    """The pid the node reports itself; the pid file's only for a node that does not answer
    (it may be stale, or on another host)."""
    return reply.pid if reply is not None and reply.pid else pids.get(node_id)


def filesystems(stats: dict) -> dict[str, dict[str, Any]]:
    """Filesystem id -> {"bytes": its size, "nodes": ids, "capacity_bytes"}. Nodes on one
    filesystem share its free space, and each reports it as its own capacity; counted once,
    their capacity is the free space plus what each holds, at most the sum of their limits."""
    by_fs: dict[str, list[tuple[str, pb.StatsReply]]] = {}
    for node_id, reply in stats.items():
        if reply is not None:
            by_fs.setdefault(reply.filesystem_id or f"node:{node_id}", []).append((node_id, reply))
    result = {}
    for fs_id, members in by_fs.items():
        held = [r.used_bytes + r.index_bytes for _, r in members]
        free = max(r.capacity_bytes - h for (_, r), h in zip(members, held, strict=True))
        limits = sum(r.capacity_bytes for _, r in members)
        result[fs_id] = {
            "bytes": members[0][1].filesystem_bytes,
            "nodes": [node_id for node_id, _ in members],
            "capacity_bytes": min(limits, max(free, 0) + sum(held)),
        }
    return result


def cluster_capacity_bytes(stats: dict) -> int:
    """The answering nodes' capacity, each shared filesystem counted once."""
    return sum(entry["capacity_bytes"] for entry in filesystems(stats).values())


def status_document(
    config: ClusterConfig,
    cluster_toml: Path,
    pids: dict[str, int],
    stats: dict,
    live: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``--json`` form of the status (see the module docstring). ``live``: the nodes
    registered in etcd (None without etcd membership)."""
    shares = share_report(config.nodes, config.groups, map_group_weights(config))
    return {
        "cluster_toml": str(cluster_toml),
        "epoch": config.epoch,
        "membership": config.membership.etcd or "static",
        "moving": bool(config.moving_from),
        "capacity_bytes": cluster_capacity_bytes(stats),
        "filesystems": filesystems(stats),
        "tls": config.tls_enabled,
        "auth": any(n.credentials_file for n in config.nodes),
        **repair_figures(stats),
        "retention_caps": retention_caps(stats),
        "nodes": [
            {
                **_node_record(node, node_pid(node.id, pids, stats[node.id]), stats[node.id], live),
                **_share_record(shares[node.id]),
            }
            for node in config.nodes
        ],
    }


def _share_record(share_weight: tuple[float, float]) -> dict[str, float]:
    """A node's fraction of the shards placement gives it, and of the weight (byte limits)."""
    share, weight = share_weight
    return {"placement_share": round(share, 6), "weight_share": round(weight, 6)}


def repair_figures(stats: dict) -> dict[str, Any]:
    """The cluster's repair figures: the backlog (shards its readable blocks lack, as the
    leaders' latest looks found them), of which waiting on nodes that are down, the blocks
    at risk (fewer than k+m shards), the slowest leader's ETA at its repair rate, and how
    many led groups still wait for a listing (their backlog is not known yet)."""
    repairs = [r.repair for r in stats.values() if r is not None]
    return {
        "repair_backlog_shards": sum(r.backlog_shards for r in repairs),
        "repair_waiting_shards": sum(r.waiting_shards for r in repairs),
        "at_risk_blocks": sum(r.at_risk_blocks for r in repairs),
        "repair_eta_s": max((r.eta_s for r in repairs), default=0.0),
        "repair_pending_groups": sum(r.pending_groups for r in repairs),
        "evicted_blocks": sum(r.evicted_blocks for r in stats.values() if r is not None),
    }


def repair_summary(stats: dict) -> str:
    """One line of :func:`repair_figures` for the table view."""
    f = repair_figures(stats)
    pending = f"; {f['repair_pending_groups']} groups not listed yet" * bool(
        f["repair_pending_groups"]
    )
    return (
        f"repair backlog {f['repair_backlog_shards']} shards ({f['repair_waiting_shards']} "
        f"wait for their node to return), {f['at_risk_blocks']} blocks at risk, ETA "
        f"{f['repair_eta_s']:.0f} s{pending}; {f['evicted_blocks']} blocks evicted"
    )


def _node_record(
    node: NodeConfig, pid: int | None, reply: pb.StatsReply | None, live: dict[str, Any] | None
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": node.id,
        "address": node.address,
        "failure_domain": node.failure_domain,
        "state": node.state,
        "registered": None if live is None else node.id in live,
        "pid": pid,
        "up": reply is not None,
    }
    if reply is None:
        return record
    record.update(
        shards=reply.shards,
        bytes=reply.bytes,
        used_bytes=reply.used_bytes,
        index_bytes=reply.index_bytes,
        capacity_bytes=reply.capacity_bytes,
        quarantined_bytes=reply.quarantined_bytes,
        corrupt_shards=reply.corrupt_shards,
        segments=reply.segments,
        hits=reply.hits,
        misses=reply.misses,
        retired_versions=reply.retired_versions,
        evicted_blocks=reply.evicted_blocks,
        peer_removed_shards=reply.peer_removed_shards,
        compacted_bytes=reply.compacted_bytes,
        dead_bytes=reply.dead_bytes,
        at_risk_blocks=reply.repair.at_risk_blocks,
        last_tombstone_seq=reply.last_tombstone_seq,
        epoch=reply.epoch,
        filesystem_id=reply.filesystem_id,
        repair=_repair_record(reply.repair),
        classes=[_class_record(c) for c in reply.classes],
    )
    return record


def _repair_record(repair: pb.RepairStats) -> dict[str, Any]:
    figures = ("backlog_shards", "rebuilt_shards", "rebuilt_bytes", "read_bytes")
    figures += ("skipped_expiring", "unrecoverable", "fenced", "queued_hints", "passes")
    figures += ("waiting_shards", "at_risk_blocks", "backlog_bytes", "eta_s", "pending_groups")
    figures += ("ready",)
    return {
        **{name: getattr(repair, name) for name in figures},
        "led_groups": list(repair.led_groups),
    }


def _class_record(c: pb.ClassStats) -> dict[str, Any]:
    return {
        "traffic_class": c.traffic_class,
        "shards": c.blocks,
        "bytes": c.bytes,
        "hits": c.hits,
        "misses": c.misses,
        "expired": c.expired,
        "evicted": c.evicted,
        "youngest_evicted_age_s": _youngest(c),
    }


def _youngest(c: pb.ClassStats) -> float | None:
    """Age of the youngest evicted entry; None while nothing was evicted."""
    return c.youngest_evicted_age_s if c.HasField("youngest_evicted_age_s") else None


def print_status(
    root: Path,
    pids: dict[str, int],
    *,
    as_json: bool = False,
    token: str | None = None,
    client_cert: tuple[str | None, str | None] = (None, None),
    cluster_toml: Path | None = None,
) -> int:
    """Print the tables (or JSON); exit status 0 when every node answers, 1 otherwise.
    With etcd membership the map is etcd's, and nodes "left" need not answer.
    ``cluster_toml``: the map, when it is not ``root/cluster.toml``."""
    started_s = time.monotonic()
    cluster_toml = cluster_toml or root / "cluster.toml"
    in_force = current_map(load_cluster(cluster_toml), cluster_toml)
    config = in_force.config
    stats = fetch_stats(config, token, client_cert)
    if as_json:
        document = status_document(config, cluster_toml, pids, stats, in_force.live)
        document.update(map_source=in_force.source, etcd_error=in_force.etcd_error or None)
        document["etcd_reachable"] = None if in_force.source == "file" else not in_force.etcd_error
        document["elapsed_s"] = round(time.monotonic() - started_s, 3)  # etcd and Stats calls
        print(json.dumps(document, indent=1))
    else:
        console = make_console()
        if in_force.etcd_error:
            console.print(
                f"[yellow]{in_force.etcd_error}: etcd is unreachable; the nodes below are "
                f"those of the cached map (epoch {config.epoch}), which may be stale[/yellow]"
            )
        print_fitted(node_table(config, pids, stats), console, keep=("up",))
        console.print(repair_summary(stats))
        print_fitted(class_table(stats), console, keep=("class",))
        if caps := retention_caps(stats):
            print_fitted(caps_table(caps), console, keep=("tenant",))
    expected = [n.id for n in config.nodes if n.state != "left"]
    return 0 if all(stats[node_id] is not None for node_id in expected) else 1


@dataclass(frozen=True)
class MapInForce:
    """The map status reports on, where it came from, and the nodes registered in etcd."""

    config: ClusterConfig
    source: str  # "file" (no etcd), "etcd", or "cache" (etcd did not answer)
    live: dict[str, Any] | None = None  # None: not known (no etcd, or etcd down)
    etcd_error: str = ""


def current_map(config: ClusterConfig, cluster_toml: Path | None = None) -> MapInForce:
    """The map in force: etcd's when ``[membership] etcd`` is set (cached beside
    ``cluster_toml``), else the file's; when etcd does not answer within ``ETCD_TIMEOUT_S``,
    the cached map or the file's, whichever is newer (kvstore/map_cache.py)."""
    if not config.membership.endpoints:
        return MapInForce(config, "file")

    async def read() -> tuple[ClusterConfig, dict[str, Any]]:
        async with EtcdMembership(config.membership) as membership:
            got = await membership.get_map()
            return (got[0] if got else config), await membership.live_members()

    async def read_in_time() -> tuple[ClusterConfig, dict[str, Any]]:
        return await asyncio.wait_for(read(), ETCD_TIMEOUT_S)

    try:
        etcd_map, live = asyncio.run(read_in_time())
    except (Unavailable, TimeoutError) as exc:
        fallback = config if cluster_toml is None else fallback_map(cluster_toml, config)
        error = str(exc) or f"no answer in {ETCD_TIMEOUT_S:g} s"
        return MapInForce(fallback, "cache", etcd_error=f"etcd {config.membership.etcd}: {error}")
    if cluster_toml is not None:
        save_cached_map(cluster_toml, etcd_map)
    return MapInForce(etcd_map, "etcd", live)
