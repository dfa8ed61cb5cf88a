"""``MapFollower``: a client's view of the cluster map when the map lives in etcd.

With ``[membership] etcd`` set in cluster.toml the file only seeds the map: etcd's map wins
at connect, and the client switches to each newer epoch as etcd announces it, without
reconnecting (kvstore/membership.py). Without etcd the follower does nothing, so the client
treats both cases alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvstore.config import ClusterConfig
from kvstore.membership import EtcdMembership, follow_map


class MapFollower:
    """Reads etcd's map once, then follows its epochs in a background task until closed."""

    def __init__(self, config: ClusterConfig) -> None:
        endpoints = config.membership.endpoints
        membership = config.membership
        self._membership = EtcdMembership(membership, reader=True) if endpoints else None
        self._follow: asyncio.Task[None] | None = None

    async def current_map(self, config: ClusterConfig) -> ClusterConfig:
        """etcd's map, or ``config`` (the file's) when there is no etcd or no map in it yet."""
        if self._membership is None:
            return config
        got = await self._membership.get_map()
        return got[0] if got is not None else config

    def start(self, epoch: int, apply_map: Callable[[ClusterConfig], None]) -> None:
        """Call ``apply_map`` with every map of an epoch above ``epoch``, in the background."""
        if self._membership is not None:
            self._follow = asyncio.create_task(follow_map(self._membership, epoch, apply_map))

    async def close(self) -> None:
        """Stop following, then close the etcd connection. Safe before :meth:`start`."""
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        if self._membership is not None:
            await self._membership.close()
