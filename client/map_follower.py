"""``MapFollower``: a client's view of the cluster map when the map lives in etcd.

With ``[membership] etcd`` set in cluster.toml the file only seeds the map: etcd's map wins
at connect, and the client switches to each newer epoch as etcd announces it, without
reconnecting (kvstore/membership.py). Every map read from etcd is cached beside cluster.toml
(kvstore/map_cache.py), so a client connects while etcd is down: it starts on the cached map
(or the file's, whichever is newer), marks it :attr:`MapFollower.stale`, and switches as soon
as etcd answers with a newer one. Without etcd the follower does nothing, so the client treats
both cases alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from kvstore.config import ClusterConfig
from kvstore.errors import Unavailable
from kvstore.map_cache import fallback_map, save_cached_map
from kvstore.membership import EtcdMembership

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # how long connect waits for etcd before starting on the cached map
CLOSE_WAIT_S = 2.0  # how long close waits for the map's watch to end


class MapFollower:
    """Reads etcd's map once, then follows its epochs in a background task until closed.

    ``cluster_toml``: the file the map came from, beside which maps read from etcd are cached
    (None: a map given as an object, no cache).
    """

    def __init__(self, config: ClusterConfig, cluster_toml: str | Path | None = None) -> None:
        endpoints = config.membership.endpoints
        self._membership = EtcdMembership(config.membership, reader=True) if endpoints else None
        self._cluster_toml = cluster_toml
        self._follow: asyncio.Task[None] | None = None

    @property
    def stale(self) -> bool:
        """Whether the map in use may be behind etcd's: etcd has not answered since the client
        fell back to the cached map, or stopped answering (it may have changed meanwhile)."""
        return self._membership is not None and self._membership.reachable is not True

    @property
    def num_etcd_outages(self) -> int:
        """Times etcd stopped answering since connect (each logged once)."""
        return self._membership.num_outages if self._membership is not None else 0

    async def current_map(self, config: ClusterConfig) -> ClusterConfig:
        """etcd's map, or ``config`` (the file's) when there is no etcd or no map in it yet;
        while etcd does not answer, the cached map or ``config``, whichever is newer."""
        if self._membership is None:
            return config
        try:
            got = await asyncio.wait_for(self._membership.get_map(), CONNECT_TIMEOUT_S)
        except (Unavailable, TimeoutError):  # the outage itself is logged by the membership
            fallback = self._fallback(config)
            log.warning(
                "starting on the cached cluster map, epoch %d, until etcd answers", fallback.epoch
            )
            self._membership.reachable = False
            return fallback
        if got is None:
            return config
        self._cache(got[0])
        return got[0]

    def start(self, epoch: int, apply_map: Callable[[ClusterConfig], None]) -> None:
        """Call ``apply_map`` with every map of an epoch above ``epoch``, in the background."""
        if self._membership is not None:
            self._follow = asyncio.create_task(self._follow_map(epoch, apply_map))

    async def _follow_map(self, epoch: int, apply_map: Callable[[ClusterConfig], None]) -> None:
        assert self._membership is not None
        async for cfg in self._membership.watch_map():
            self._cache(cfg)
            if cfg.epoch > epoch:
                epoch = cfg.epoch
                apply_map(cfg)

    def _fallback(self, config: ClusterConfig) -> ClusterConfig:
        if self._cluster_toml is None:
            return config
        return fallback_map(self._cluster_toml, config)

    def _cache(self, cfg: ClusterConfig) -> None:
        if self._cluster_toml is not None:
            save_cached_map(self._cluster_toml, cfg)

    async def close(self) -> None:
        """Stop following, then close the etcd connection. Safe before :meth:`start`."""
        if self._follow is not None:
            self._follow.cancel()
            # Bounded: a watch may take its time to end (kvstore/membership.py _watched);
            # closing the etcd client below ends whatever is left of it.
            await asyncio.wait({self._follow}, timeout=CLOSE_WAIT_S)
        if self._membership is not None:
            await self._membership.close()
        if self._follow is not None and self._follow.done() and not self._follow.cancelled():
            self._follow.exception()  # retrieved: the follower's end is not the close's error
