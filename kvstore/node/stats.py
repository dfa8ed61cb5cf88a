"""A node's Stats reply: its store's and repair service's figures, and its filesystem's.

``kvstore cluster status`` and the benchmarks read these. The filesystem's id and size let
them see nodes that share a disk (their capacities would otherwise be counted twice).
"""

from __future__ import annotations

import os
import socket

from kvstore.node.repair_service import RepairStats
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.shard_store import ShardStore, StoreStats


def filesystem_of(path: str) -> tuple[str, int]:
    """("host:device", size in bytes) of the filesystem holding ``path`` (("", 0) if gone)."""
    try:
        device, fs = os.stat(path).st_dev, os.statvfs(path)
    except OSError:
        return "", 0
    return f"{socket.gethostname()}:{device}", fs.f_blocks * fs.f_frsize


def node_stats_reply(
    node_id: str,
    epoch: int,
    data_dir: str,
    stats: StoreStats,
    store: ShardStore | None,
    repair: RepairStats,
) -> pb.StatsReply:
    """The Stats RPC's reply: :func:`stats_reply`, this process's pid and filesystem, and
    with an open ``store`` its tenants' retention caps and its newest delete's sequence."""
    reply = stats_reply(node_id, epoch, stats, repair)
    reply.pid = os.getpid()
    reply.filesystem_id, reply.filesystem_bytes = filesystem_of(data_dir)
    if store is None:
        return reply
    for tenant, caps in sorted(store.retention.tenant_to_max_ttl_s.items()):
        for traffic_class, cap_s in sorted(caps.items()):
            reply.retention_caps.add(tenant=tenant, traffic_class=traffic_class, max_ttl_s=cap_s)
    _, reply.last_tombstone_seq = store.tombstones(0, 0)
    return reply


def stats_reply(
    node_id: str, epoch: int, stats: StoreStats, repair: RepairStats | None = None
) -> pb.StatsReply:
    """The wire form of a store's (and its repair service's) stats."""
    repair = repair or RepairStats()
    classes = [
        pb.ClassStats(
            traffic_class=c.traffic_class,
            blocks=c.blocks,
            bytes=c.bytes,
            hits=c.hits,
            misses=c.misses,
            expired=c.expired,
            evicted=c.evicted,
            youngest_evicted_age_s=c.youngest_evicted_age_s,
        )
        for c in stats.classes
    ]
    return pb.StatsReply(
        node_id=node_id,
        epoch=epoch,
        shards=stats.num_shards,
        bytes=stats.shard_bytes,
        capacity_bytes=stats.capacity_bytes,
        corrupt_shards=stats.corrupt_shards,
        classes=classes,
        segments=stats.num_segments,
        hits=stats.hits,
        misses=stats.misses,
        used_bytes=stats.used_bytes,
        index_bytes=stats.index_bytes,
        quarantined_bytes=stats.quarantined_bytes,
        retired_versions=stats.retired_versions,
        evicted_blocks=stats.evicted_blocks,
        peer_removed_shards=stats.peer_removed_shards,
        compacted_bytes=stats.compacted_bytes,
        dead_bytes=stats.dead_bytes,
        repair=_repair_stats(repair),
    )


def _repair_stats(repair: RepairStats) -> pb.RepairStats:
    return pb.RepairStats(
        backlog_shards=repair.backlog_shards,
        rebuilt_shards=repair.rebuilt_shards,
        rebuilt_bytes=repair.rebuilt_bytes,
        read_bytes=repair.read_bytes,
        skipped_expiring=repair.skipped_expiring,
        unrecoverable=repair.unrecoverable,
        fenced=repair.fenced,
        queued_hints=repair.queued_hints,
        passes=repair.passes,
        led_groups=repair.led_groups,
        waiting_shards=repair.waiting_shards,
        at_risk_blocks=repair.at_risk_blocks,
        backlog_bytes=repair.backlog_bytes,
        eta_s=repair.eta_s,
        pending_groups=repair.pending_groups,
        ready=repair.ready,
    )
