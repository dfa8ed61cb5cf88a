"""What holds a node's store across index rebuilds, and the map it is placed in.

The node opens its store in the background (Health says ``serving = false`` meanwhile). An
index that fails while serving (lmdb pages that no longer read) takes the node back to
``serving = false`` while :class:`StoreHolder` moves the index aside and rebuilds it from the
segments (kvstore/store/index_rebuild.py); data RPCs get UNAVAILABLE meanwhile, which clients
treat like a node that is down. :class:`PlacedMap` is the cluster map the store files its
entries by; the node swaps it when etcd has a newer epoch, without reopening the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import CapacityExhausted, IndexUnusable, NotServing
from kvstore.placement import Placement
from kvstore.store.recovery import move_index_aside
from kvstore.store.shard_store import ShardStore, StoreStats, empty_stats
from ttl.clock import Clock

log = logging.getLogger(__name__)


class PlacedMap:
    """The cluster map a node currently follows (swapped when etcd has a newer epoch): which
    group a key is filed under, and which shard of it this node holds."""

    def __init__(self, cluster: ClusterConfig, node_id: str) -> None:
        self.node_id = node_id
        self.set(cluster)

    def set(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self.placement = Placement(cluster)
        self.group_to_position = {
            g: m.index(self.node_id) for g, m in enumerate(cluster.groups) if self.node_id in m
        }

    def group_of(self, key: bytes) -> int:
        return self.placement.group_index(key)

    def shard_index_of(self, key: bytes) -> int | None:
        return self.group_to_position.get(self.placement.group_index(key))


def open_store(
    cluster: ClusterConfig, node: NodeConfig, clock: Clock, placed: PlacedMap | None = None
) -> ShardStore:
    """The node's store, placed in the cluster: entries filed by placement group, and puts
    whose shards do not fit the cluster's code or this node's place (in the map ``placed``
    follows, if given) refused."""
    placed = placed or PlacedMap(cluster, node.id)
    return ShardStore(
        node,
        cluster.ttl,
        clock,
        group_of=placed.group_of,
        shard_index_of=placed.shard_index_of,
        codec=cluster.codec,
    )


class StoreHolder:
    """The node's store, absent while it is opened or rebuilt (Health says which)."""

    def __init__(self, open_: Callable[[], ShardStore], node: NodeConfig, executor: Executor):
        self._open = open_
        self._node = node
        self._executor = executor
        self.store: ShardStore | None = None
        self.state = "recovering"
        self.generation = 0  # bumped whenever the store comes or goes
        self._waiters: set[asyncio.Future[None]] = set()
        self._rebuild: asyncio.Task[None] | None = None

    def require(self) -> ShardStore:
        """The store, or NotServing (UNAVAILABLE) while there is none."""
        if self.store is None:
            raise NotServing(f"node {self._node.id} is not serving yet: {self.state}")
        return self.store

    def stats(self) -> StoreStats:
        return self.store.stats() if self.store is not None else empty_stats()

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        store = await loop.run_in_executor(self._executor, self._open)
        try:
            await loop.run_in_executor(self._executor, store.tick)  # expiry continues
        except CapacityExhausted as exc:  # a full disk must not keep the node from serving
            log.error("the first upkeep tick failed; the upkeep loop retries it: %s", exc)
        self.store, self.state = store, "serving"
        self._changed()

    async def changed_since(self, generation: int) -> None:
        """Return once the store came or went after ``generation`` (at once if it has):
        Health's mirror and the delete-log pull wait here instead of polling."""
        if self.generation != generation:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)

    def _changed(self) -> None:
        self.generation += 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def rebuild_after(self, exc: IndexUnusable) -> None:
        """Stop serving and rebuild the index from the segments (once, however many RPCs
        saw the failure)."""
        if self._rebuild is None or self._rebuild.done():
            log.error("node %s: %s; rebuilding its index", self._node.id, exc)
            store, self.store, self.state = self.store, None, "rebuilding index"
            self._changed()
            self._rebuild = asyncio.ensure_future(self._rebuild_index(store, str(exc)))

    async def _rebuild_index(self, store: ShardStore | None, why: str) -> None:
        loop = asyncio.get_running_loop()
        if store is not None:
            await loop.run_in_executor(self._executor, _close_quietly, store)
        index_dir = Path(self._node.data_dir) / "index"
        await loop.run_in_executor(self._executor, move_index_aside, index_dir, why)
        await self.open()

    async def close(self) -> None:
        if self._rebuild is not None:
            await asyncio.gather(self._rebuild, return_exceptions=True)
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.store.close)
            self.store = None


def _close_quietly(store: ShardStore) -> None:
    try:
        store.close()
    except Exception:
        log.exception("closing the store with the damaged index failed")
