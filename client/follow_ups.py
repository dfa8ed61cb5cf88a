"""What a client sends after a read or a write, in the background: TTL touches and repair hints.

* **Touches.** A read hit refreshes the TTL only on the nodes that served it (10 or 11 of 12);
  the shard nobody read would expire early and leave the block one failure from loss. So after
  every hit the client touches (``TouchShards``: refresh, read nothing) the block's shards on
  the nodes that did not serve it: the reserve nodes and those whose reply was not needed.
* **Repair hints.** A read that decoded around a missing or corrupt shard, and a write that
  returned with fewer than k+m shards stored, tell the group's leader (``QueueRepair``), which
  rebuilds those shards without waiting for its next pass (kvstore/node/repair_service.py).

Both are batched per node (one RPC per node per flush, at most ``TOUCH_FLUSH_S`` or
``FLUSH_DELAY_S`` after the first item) and fire-and-forget: a read never waits for them, and
a failed send is dropped and counted, never retried, because losing one costs at most a
refresh (the repair pass rebuilds an expired shard) or a quicker repair (the pass finds it
anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from client.node_conn import NodeConn
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.05
# Touches wait longer: a refresh that comes half a second late costs nothing against TTLs of
# days, and an engine reading every 50-100 ms then sends a node one TouchShards per few
# fetches, not one per fetch (each gRPC call costs the node about as much CPU as reading 1 MB).
TOUCH_FLUSH_S = 0.5
MAX_BATCH_ITEMS = 512

Item = TypeVar("Item")


@dataclass
class FollowUpCounters:
    num_touches: int = 0  # shards touched after read hits
    num_repair_hints: int = 0  # blocks hinted to their group's leader
    num_follow_up_failures: int = 0  # touch or hint RPCs that failed (dropped)


class NodeBatches(Generic[Item]):
    """Items for nodes, sent in the background as one ``send(node_id, items)`` per node per
    flush."""

    def __init__(
        self,
        send: Callable[[str, list[Item]], Awaitable[None]],
        counters: FollowUpCounters,
        delay_s: float = FLUSH_DELAY_S,
    ) -> None:
        self._send = send
        self._counters = counters
        self._delay_s = delay_s
        self._pending: dict[str, list[Item]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, node_id: str, item: Item) -> None:
        items = self._pending.setdefault(node_id, [])
        items.append(item)
        if len(items) >= MAX_BATCH_ITEMS:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        for node_id, items in pending.items():
            task = asyncio.ensure_future(self._send_quietly(node_id, items))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_quietly(self, node_id: str, items: list[Item]) -> None:
        try:
            await self._send(node_id, items)
        except KVStoreError as exc:
            self._counters.num_follow_up_failures += 1
            log.debug("follow-up to node %s dropped: %s", node_id, exc)

    async def close(self) -> None:
        """Send what is pending and wait for every send."""
        self._flush()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class FollowUps:
    """The touches and repair hints of one client (see the module docstring)."""

    def __init__(
        self,
        conns: dict[str, NodeConn],
        groups: Sequence[Sequence[str]],
        tenant: str,
        timeout_s: float,
    ) -> None:
        self._conns = conns
        self._groups = groups
        self._tenant = tenant
        self._timeout_s = timeout_s
        self.counters = FollowUpCounters()
        self._touches: NodeBatches[tuple[bytes, bytes]] = NodeBatches(
            self._touch, self.counters, TOUCH_FLUSH_S
        )
        self._hints: NodeBatches[tuple[bytes, int]] = NodeBatches(self._hint, self.counters)

    def set_groups(self, groups: Sequence[Sequence[str]]) -> None:
        """The groups of a newer map epoch (hints go to their new leaders)."""
        self._groups = groups

    def touch(self, node_ids: Sequence[str], key: bytes, version: bytes) -> None:
        """Refresh ``key``'s shard of ``version`` on these nodes (they did not serve it)."""
        for node_id in node_ids:
            self._touches.add(node_id, (key, version))
        self.counters.num_touches += len(node_ids)

    def hint_repair(self, group: int, key: bytes) -> None:
        """Tell the group's leader that ``key``'s block is short of shards."""
        self._hints.add(self._leader(group), (key, group))
        self.counters.num_repair_hints += 1

    def _leader(self, group: int) -> str:
        """The group's first member not suspected down: the node that leads its repair."""
        members = self._groups[group]
        return next((m for m in members if not self._conns[m].is_suspect()), members[0])

    async def _touch(self, node_id: str, items: list[tuple[bytes, bytes]]) -> None:
        items = list(dict.fromkeys(items))  # a block read again within the flush: once
        request = pb.TouchShardsRequest(
            tenant=self._tenant, keys=[k for k, _ in items], versions=[v for _, v in items]
        )
        await self._conns[node_id].call("TouchShards", request, self._timeout_s)

    async def _hint(self, node_id: str, items: list[tuple[bytes, int]]) -> None:
        hints = [pb.RepairHint(tenant=self._tenant, key=k, group=g) for k, g in items]
        await self._conns[node_id].call(
            "QueueRepair", pb.QueueRepairRequest(hints=hints), self._timeout_s
        )

    async def close(self) -> None:
        await self._touches.close()
        await self._hints.close()
