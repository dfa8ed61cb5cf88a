"""The key commands of :class:`~client.kv_client.KVClient`: which keys are readable, deletes
that must reach every copy, and the questions a client asks every node (stats, whether its
token is accepted yet). Each sends one batched RPC per node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from client.keys import as_key
from client.node_conn import consume_result
from client.shard_tally import PresenceTally
from kvstore.errors import KVStoreError, PermissionDenied, Unavailable
from kvstore.proto import kvstore_pb2 as pb

if TYPE_CHECKING:
    from client.kv_client import Key, KVClient

log = logging.getLogger(__name__)


class KeyOps:
    """A client's key commands (its ``key_ops``), on the client's current map."""

    def __init__(self, client: KVClient) -> None:
        self.c = client

    async def contains(self, keys: Sequence[Key], timeout_s: float | None) -> list[bool]:
        """:meth:`KVClient.contains`: done once every key is decided, or at the deadline."""
        keys = [as_key(key) for key in keys]
        timeout_s = self.c.resolve_timeout_s(timeout_s)
        node_to_positions = self.positions_by_node(keys)
        num_asked = [0] * len(keys)  # k+m, or more during a map change (both placements)
        for positions in node_to_positions.values():
            for position in positions:
                num_asked[position] += 1
        tally = PresenceTally(num_asked, self.c.config.codec.k)

        async def ask(node_id: str, positions: list[int]) -> None:
            request = pb.ContainsRequest(tenant=self.c.tenant, keys=[keys[p] for p in positions])
            try:
                reply = await self.c.conns[node_id].call("Contains", request, timeout_s)
            except PermissionDenied:
                raise
            except KVStoreError:
                for position in positions:
                    tally.add_no_reply(position)
                return
            for position, result in zip(positions, reply.results, strict=True):
                tally.add_reply(position, result.versions)

        calls = [ask(node_id, positions) for node_id, positions in node_to_positions.items()]
        await run_until(calls, lambda: tally.all_decided, timeout_s)
        return [bool(readable) for readable in tally.readable]

    async def delete(self, keys: Sequence[Key], timeout_s: float | None) -> None:
        """:meth:`KVClient.delete`: every node of each key's groups (both during a move)."""
        keys = [as_key(key) for key in keys]
        node_to_positions = self.positions_by_node(keys)
        request_of = {
            node_id: pb.DeleteRequest(tenant=self.c.tenant, keys=[keys[p] for p in positions])
            for node_id, positions in node_to_positions.items()
        }
        timeout_s = self.c.resolve_timeout_s(timeout_s)
        replies = await asyncio.gather(
            *(self.c.conns[n].call("Delete", r, timeout_s) for n, r in request_of.items()),
            return_exceptions=True,
        )
        self.check_deleted(keys, node_to_positions, replies)

    def check_deleted(
        self,
        keys: Sequence[bytes],
        node_to_positions: dict[str, list[int]],
        replies: list[Any],
    ) -> None:
        """Raise unless every key's delete reached m+1 nodes (a refused token raises too)."""
        num_confirmed = [0] * len(keys)
        for positions, reply in zip(node_to_positions.values(), replies, strict=True):
            if isinstance(reply, PermissionDenied):
                raise reply
            if isinstance(reply, BaseException):
                continue
            for position in positions:
                num_confirmed[position] += 1
        needed = self.c.config.codec.m + 1
        if any(n < needed for n in num_confirmed):
            failed = [r for r in replies if isinstance(r, BaseException)]
            raise Unavailable(
                f"delete reached fewer than {needed} nodes for some keys, so their blocks may "
                f"still be readable ({failed[:3]}); retry the delete when the nodes are back"
            )

    def positions_by_node(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Node id -> positions of the keys it holds a shard of (one batch per node); during
        a map change the old placement's nodes too, so a delete reaches every copy."""
        node_to_positions: dict[str, list[int]] = {}
        previous = self.c.config.moving_from
        for group_index, positions in self.c.placement.keys_by_group(keys).items():
            members = dict.fromkeys(self.c.config.groups[group_index])
            members.update(dict.fromkeys(previous[group_index] if previous else ()))
            for node_id in members:
                node_to_positions.setdefault(node_id, []).extend(positions)
        return node_to_positions

    async def node_stats(self, timeout_s: float | None) -> dict[str, pb.StatsReply | None]:
        """:meth:`KVClient.node_stats`: each node's Stats reply, or None."""
        timeout_s = self.c.resolve_timeout_s(timeout_s)
        replies = await asyncio.gather(
            *(conn.call("Stats", pb.StatsRequest(), timeout_s) for conn in self.c.conns.values()),
            return_exceptions=True,
        )
        return {
            node_id: None if isinstance(reply, BaseException) else reply
            for node_id, reply in zip(self.c.conns, replies, strict=True)
        }

    async def wait_until_accepted(self, timeout_s: float) -> None:
        """:meth:`KVClient.wait_until_accepted`: ask every node until none refuses."""
        request = pb.ContainsRequest(tenant=self.c.tenant, keys=[bytes(16)])
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        while True:
            calls = (conn.call("Contains", request, 5.0) for conn in self.c.conns.values())
            replies = await asyncio.gather(*calls, return_exceptions=True)
            refused = [
                n
                for n, r in zip(self.c.conns, replies, strict=True)
                if isinstance(r, PermissionDenied)
            ]
            if not refused:
                return
            if loop.time() > deadline_s:
                raise Unavailable(
                    f"nodes {', '.join(refused)} still refuse this client's token after "
                    f"{timeout_s:g} s: is it in their credentials file?"
                )
            await asyncio.sleep(0.1)


async def run_until(
    calls: Sequence[Awaitable[None]], is_done: Callable[[], bool], timeout_s: float
) -> None:
    """Run ``calls`` concurrently until ``is_done()`` or all finish or the timeout; cancel rest.

    Exceptions other than the ones the calls handle themselves propagate (the first one; the
    others of the same turn are retrieved, so asyncio never reports them as lost).
    """
    tasks = {asyncio.ensure_future(call) for call in calls}
    try:
        async with asyncio.timeout(timeout_s):
            while tasks and not is_done():
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
                if errors:
                    raise errors[0]
    except TimeoutError:
        log.debug("contains: deadline passed with %d nodes outstanding", len(tasks))
    finally:
        for task in tasks:
            task.cancel()
            task.add_done_callback(consume_result)
