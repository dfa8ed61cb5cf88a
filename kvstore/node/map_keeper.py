"""The map keeper: inside every node, following etcd's map and, on one node, changing it.

Two tasks per node with etcd membership (kvstore/node/main.py starts them):

* :func:`kvstore.membership.follow_map` applies every newer map epoch from the watch
  without a restart: placement, the shards this node accepts, its repair service's groups.
* :func:`keep_map` acts only on the *keeper*, the live node (registered in etcd) with the
  lowest id, so exactly one node acts while leases agree, and a second acting for a moment
  only loses a compare-and-swap. Every ``KEEPER_PERIOD_S`` it:

  1. marks out a node that is "in" but has had no live lease for ``down_out_s`` of cluster
     time (the ``[ttl]`` clock, so tests can scale it; Ceph's mon_osd_down_out_interval is
     the same 600 s default). Before that a down node is a hedged-read case, nothing more;
  2. while a move is in progress (``moving_from``), repairs each changed group now (k verified
     survivors decoded, shard i rebuilt onto the new member i: kvstore/node/repair_service.py),
     then lists the group again: once every changed slot's new member holds its shard of
     every readable block, it finishes the move (:func:`kvstore.map_changes.finish_move`).
     Only then is a draining node "left", and only a left node can be removed: no shard's
     last copies are dropped before the new copy is verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvstore.config import ClusterConfig
from kvstore.errors import KVStoreError, Unavailable
from kvstore.map_changes import changed_slots, finish_move, mark_out
from kvstore.membership import EtcdMembership
from kvstore.node.repair_service import RepairService
from ttl.clock import Clock

log = logging.getLogger(__name__)

KEEPER_PERIOD_S = 1.0
NEVER_SEEN_GRACE_S = 120.0  # real seconds: see DownClock


class _Changed(Exception):
    """The map moved on since the keeper looked: its change no longer applies."""


async def keep_map(
    membership: EtcdMembership,
    node_id: str,
    current: Callable[[], ClusterConfig],
    repair: RepairService,
    clock: Clock,
) -> None:
    """The keeper's loop (see the module docstring); a no-op on every other node."""
    down_clock = DownClock()
    while True:
        await asyncio.sleep(KEEPER_PERIOD_S)
        try:
            live = await membership.live_members()
            if not live or min(live) != node_id:
                down_clock.clear()  # another node keeps the map; start afresh if we take over
                continue
            cfg = current()
            await _mark_out_down_nodes(membership, cfg, set(live), down_clock, clock.now())
            if cfg.moving_from and repair.epoch == cfg.epoch and await move_done(cfg, repair):
                await membership.change_map(lambda c, cfg=cfg: _finish_if_same(c, cfg.epoch))
        except _Changed:
            continue
        except Unavailable as exc:  # etcd down: the membership logs an outage once
            log.debug("map keeper on %s: %s", node_id, exc)
        except (KVStoreError, ValueError) as exc:
            log.warning("map keeper on %s: %s", node_id, exc)
        except Exception:
            log.exception("map keeper on %s failed; retrying", node_id)


class DownClock:
    """When each node of the map went down, on the cluster clock, as one keeper saw it.

    A node counts as down from the first look that misses its lease after a look that saw
    it; a node this keeper never saw live (it joined and is still starting, or it was down
    before this keeper took over) gets ``NEVER_SEEN_GRACE_S`` real seconds more, so a slow
    start on a loaded host is not taken for a failure."""

    def __init__(self) -> None:
        self._down_since_s: dict[str, float] = {}
        self._seen: set[str] = set()

    def clear(self) -> None:
        self._down_since_s.clear()
        self._seen.clear()

    def due(self, cfg: ClusterConfig, live: set[str], now_s: float) -> list[str]:
        """The nodes "in" the map that have been down for ``down_out_s`` by ``now_s``."""
        grace_s = NEVER_SEEN_GRACE_S * cfg.ttl.time_scale
        due = []
        for node in cfg.nodes:
            if node.id in live:
                self._seen.add(node.id)
            if node.state != "in" or node.id in live:
                self._down_since_s.pop(node.id, None)
                continue
            since_s = self._down_since_s.setdefault(node.id, now_s)
            wait_s = cfg.membership.down_out_s + (0.0 if node.id in self._seen else grace_s)
            if now_s - since_s >= wait_s:
                due.append(node.id)
        return due

    def forget(self, node_id: str) -> None:
        self._down_since_s.pop(node_id, None)


async def _mark_out_down_nodes(
    membership: EtcdMembership, cfg: ClusterConfig, live: set[str], clock: DownClock, now_s: float
) -> None:
    for node_id in clock.due(cfg, live, now_s):
        log.warning("node %s down for down_out_s (cluster clock): marking it out", node_id)
        with contextlib.suppress(_Changed):
            await membership.change_map(lambda c, n=node_id: _out_if_in(c, n))
        clock.forget(node_id)


def _out_if_in(cfg: ClusterConfig, node_id: str) -> ClusterConfig:
    if node_id not in {n.id for n in cfg.nodes} or cfg.node(node_id).state != "in":
        raise _Changed
    return mark_out(cfg, node_id)


def _finish_if_same(cfg: ClusterConfig, epoch: int) -> ClusterConfig:
    if cfg.epoch != epoch:
        raise _Changed
    return finish_move(cfg)


async def move_done(cfg: ClusterConfig, repair: RepairService) -> bool:
    """Repair every group the move changed, then whether each new member holds its shards."""
    group_to_positions: dict[int, set[int]] = {}
    for group, position, _, _ in changed_slots(cfg.moving_from, cfg.groups):
        group_to_positions.setdefault(group, set()).add(position)
    for group, positions in sorted(group_to_positions.items()):
        await repair.repair_group(group)
        num_needed = await repair.shards_needed(group, positions)
        if num_needed:
            log.info(
                "move of epoch %d: group %d still needs %d shards", cfg.epoch, group, num_needed
            )
            return False
    return True
