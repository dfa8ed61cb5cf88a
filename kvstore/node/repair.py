"""Repair planning: which shards a placement group is missing, in what order to rebuild them.

Pure code (no I/O, no clock): the repair service (kvstore/node/repair_service.py) lists a group's
entries on every member node, feeds each block's listing to :func:`plan_block`, orders the
plans with :func:`repair_order` and drops those :func:`expires_before_rebuilt` says are not
worth it, then rebuilds what is left from k verified survivors.

What a block needs (:func:`plan_block`), from every member's listing of its key::

    versions of the key   -> the target is the newest version that has >= k distinct shard
                             indices still live (older versions are retired by nodes as soon as a
                             newer one commits; a newer version with < k shards is unreadable,
                             so the readable older one is what readers get and what we keep)
    no such version       -> unrecoverable (fewer than k shards of anything: a failed write,
                             or a block deleted on most nodes): left to expire, never rebuilt
    member at position i  -> it must hold shard i of the target version; it needs that shard
                             unless it holds it, or holds a newer version (that node would
                             supersede our write anyway), or is down (counted as waiting: the
                             shard goes to its owner, never elsewhere)

Order (:func:`repair_order`): most missing shards first (a block with 10 of 12 shards is one
failure from loss, one with 11 is two), then the longest remaining lifetime first: a block
about to expire anyway is worth least, and one with days left is exposed longest. A block whose
expiry comes before the rebuild would finish at the throttled rate (everything queued ahead of
it, plus its own bytes) is skipped (:func:`expires_before_rebuilt`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Listed:
    """One shard entry a member node listed for a key (kvstore.proto ListedShard)."""

    position: int  # the member's position in the group
    version: bytes
    shard_index: int
    written_at_s: float
    expires_at_s: float
    traffic_class: str
    shard_bytes: int


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """A block to rebuild: its target version, where its survivors are, what is missing."""

    tenant: str
    key: bytes
    version: bytes
    traffic_class: str
    written_at_s: float
    expires_at_s: float  # the latest survivor's: rebuilt shards keep it (no fresh TTL)
    shard_bytes: int
    k: int
    holders: tuple[int, ...]  # positions holding a shard of the version (their own index)
    missing: tuple[int, ...]  # positions whose node is up and needs its shard
    waiting: tuple[int, ...]  # positions that need their shard but whose node is down

    @property
    def cost_bytes(self) -> int:
        """Bytes a rebuild moves: k survivors' shards read, the missing shards written."""
        return self.shard_bytes * (self.k + len(self.missing))


@dataclass(frozen=True, slots=True)
class Unrecoverable:
    """A key with no version of at least k live shards (never rebuilt)."""

    tenant: str
    key: bytes
    best_count: int


def plan_block(
    tenant: str,
    key: bytes,
    listed: Iterable[Listed],
    up_positions: Collection[int],
    k: int,
    width: int,
    now_s: float,
) -> BlockPlan | Unrecoverable | None:
    """What one block needs (see the module docstring); None when it needs nothing.

    ``listed``: every member's entries of the key. ``up_positions``: the group positions whose
    node answered the listing; the others are down. ``width``: k + m.
    """
    live = [e for e in listed if e.expires_at_s > now_s]
    if not live:
        return None
    # A shard counts only where it belongs: shard i on the node at position i.
    placed = [e for e in live if e.shard_index == e.position]
    version_to_entries: dict[bytes, list[Listed]] = {}
    for entry in placed:
        version_to_entries.setdefault(entry.version, []).append(entry)
    readable = [entries for entries in version_to_entries.values() if len(entries) >= k]
    if not readable:
        best = max((len(v) for v in version_to_entries.values()), default=0)
        return Unrecoverable(tenant, key, best)
    entries = max(readable, key=_version_order)
    order = _version_order(entries)
    holders = {e.position for e in entries}
    newer = {e.position for e in live if (e.written_at_s, e.version) > order}
    needing = [p for p in range(width) if p not in holders and p not in newer]
    missing = tuple(p for p in needing if p in up_positions)
    waiting = tuple(p for p in needing if p not in up_positions)
    if not needing:
        return None
    return BlockPlan(
        tenant=tenant,
        key=key,
        version=entries[0].version,
        traffic_class=entries[0].traffic_class,
        written_at_s=order[0],
        expires_at_s=max(e.expires_at_s for e in entries),
        shard_bytes=entries[0].shard_bytes,
        k=k,
        holders=tuple(sorted(holders)),
        missing=missing,
        waiting=waiting,
    )


def _version_order(entries: Sequence[Listed]) -> tuple[float, bytes]:
    """Which version is newer: its write time, then its bytes (as nodes order them)."""
    return (max(e.written_at_s for e in entries), entries[0].version)


def repair_order(plans: Iterable[BlockPlan]) -> list[BlockPlan]:
    """Most missing shards first, then the longest remaining lifetime first."""
    return sorted(plans, key=lambda p: (-len(p.missing), -p.expires_at_s))


def expires_before_rebuilt(
    plan: BlockPlan, bytes_ahead: int, bytes_per_s: float, now_s: float
) -> bool:
    """Whether the block expires before its rebuild would finish: ``bytes_ahead`` queued
    before it plus its own cost, moved at ``bytes_per_s``."""
    if math.isinf(plan.expires_at_s) or bytes_per_s <= 0:
        return False
    return plan.expires_at_s <= now_s + (bytes_ahead + plan.cost_bytes) / bytes_per_s


def group_leader(group: Sequence[str], node_id: str, is_up: Callable[[str], bool]) -> bool:
    """Whether ``node_id`` leads ``group``: it is the first member, by position, that is up
    (``is_up`` is asked only about the members before it)."""
    for member in group:
        if member == node_id:
            return True
        if is_up(member):
            return False
    return False
