"""A node's figures, per node and per traffic class, built from the index's counters.

Counting rules: a get of a key counts one hit (under the class of the shards served) or one
miss. Every miss counts for the node (``NODE_MISSES``); it also counts for a class when the key
has entries of that class that could not be served (expired or corrupt). A key the node does
not hold (or not in the requested version) has no class: it is only in the node's miss count.
Per-class blocks and bytes are kept by the index itself (kvstore/store/index.py), in the same
transaction as the entries they count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.store.index import USED_BYTES, class_counter

CORRUPT_SHARDS = "node/corrupt_shards"
NODE_MISSES = "node/misses"  # every miss, including keys with no known class
# Kept here (the figures' one place); eviction, deletion and compaction add to them.
EVICTED_BLOCKS = "node/evicted_blocks"  # blocks evicted for the group (a tombstone logged)
PEER_REMOVED_SHARDS = "node/peer_removed_shards"  # removed by peers' deletes and evictions
COMPACTED_BYTES = "node/compacted_bytes"  # segment bytes freed by background compaction


@dataclass(frozen=True)
class ClassStats:
    traffic_class: str
    blocks: int
    bytes: int
    hits: int
    misses: int
    expired: int
    evicted: int
    youngest_evicted_age_s: float | None  # smallest now - last_access_s among evicted


@dataclass(frozen=True)
class StoreStats:
    num_shards: int
    shard_bytes: int  # bytes of live shards
    used_bytes: int  # disk bytes segment data holds: live records, + dead ones not punched
    capacity_bytes: int  # what segment data may use: the byte limit less the index files
    num_segments: int
    corrupt_shards: int
    hits: int
    misses: int  # includes keys of no known class
    classes: tuple[ClassStats, ...]
    scrubbed_bytes: int = 0  # record bytes the background scrub verified since start-up
    num_scrub_passes: int = 0  # full scrub passes finished since start-up
    last_full_pass_s: float | None = None  # store-clock time the last full pass ended
    last_full_pass_unix_s: float | None = None  # the same instant in real (Unix) time
    index_bytes: int = 0  # disk bytes of the index files (inside used_bytes' limit)
    quarantined_bytes: int = 0  # bytes of segment files moved to quarantine/
    retired_versions: int = 0  # older versions dropped because a newer one committed
    evicted_blocks: int = 0  # blocks evicted for the whole group (kvstore/store/eviction.py)
    peer_removed_shards: int = 0  # shards removed by peers' deletes and evictions
    compacted_bytes: int = 0  # segment bytes freed by background compaction
    dead_bytes: int = 0  # bytes of segment records no entry uses (freed by compaction)


@dataclass(frozen=True)
class ScrubProgress:
    """How far the background scrub got since the store opened (kept in memory only)."""

    scrubbed_bytes: int = 0
    num_passes: int = 0
    last_full_pass_s: float | None = None
    last_full_pass_unix_s: float | None = None


def store_stats(
    counters: Counter[str],
    class_names: Iterable[str],
    *,
    num_segments: int,
    capacity_bytes: int,
    scrub: ScrubProgress,
    index_bytes: int = 0,
    quarantined_bytes: int = 0,
    retired_versions: int = 0,
    dead_bytes: int = 0,
    dead_bytes_free: bool = False,
) -> StoreStats:
    """Node and class figures from the counters (persisted plus pending ones).

    ``dead_bytes_free``: the filesystem punches holes, so dead records hold no disk space."""
    names = dict.fromkeys(class_names)
    names.update(dict.fromkeys(_classes_in(counters)))
    classes = tuple(_class_stats(name, counters) for name in names)
    return StoreStats(
        num_shards=sum(c.blocks for c in classes),
        shard_bytes=sum(c.bytes for c in classes),
        # Dead records whose holes were punched hold no space (kvstore/store/eviction.py).
        used_bytes=int(counters[USED_BYTES]) - (dead_bytes if dead_bytes_free else 0),
        capacity_bytes=capacity_bytes,
        num_segments=num_segments,
        corrupt_shards=int(counters[CORRUPT_SHARDS]),
        hits=sum(c.hits for c in classes),
        misses=int(counters[NODE_MISSES]),
        classes=classes,
        scrubbed_bytes=scrub.scrubbed_bytes,
        num_scrub_passes=scrub.num_passes,
        last_full_pass_s=scrub.last_full_pass_s,
        last_full_pass_unix_s=scrub.last_full_pass_unix_s,
        index_bytes=index_bytes,
        quarantined_bytes=quarantined_bytes,
        retired_versions=retired_versions,
        evicted_blocks=int(counters[EVICTED_BLOCKS]),
        peer_removed_shards=int(counters[PEER_REMOVED_SHARDS]),
        compacted_bytes=int(counters[COMPACTED_BYTES]),
        dead_bytes=dead_bytes,
    )


def _classes_in(counters: Counter[str]) -> list[str]:
    return [name.split("/")[1] for name in counters if name.startswith("class/")]


def _class_stats(name: str, counters: Counter[str]) -> ClassStats:
    def get(figure: str) -> int:
        return int(counters[class_counter(name, figure)])

    youngest = class_counter(name, "youngest_evicted_age_s")
    return ClassStats(
        traffic_class=name,
        blocks=get("blocks"),
        bytes=get("bytes"),
        hits=get("hits"),
        misses=get("misses"),
        expired=get("expired"),
        evicted=get("evicted"),
        youngest_evicted_age_s=counters.get(youngest),
    )


def empty_stats() -> StoreStats:
    """The figures of a node whose store is not open (yet): all zero."""
    return store_stats(Counter(), (), num_segments=0, capacity_bytes=0, scrub=ScrubProgress())
