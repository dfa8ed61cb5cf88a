"""The write command of :class:`~client.kv_client.KVClient`: a batch of blocks checked,
sealed when the tenant's are, and written to their groups (client/write_path.py sends it);
shard puts left running past a put's return finish in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from client.buffers import Buffer, byte_view
from client.keys import as_key
from client.sealer import OVERHEAD_BYTES
from client.write_path import BatchWrite, WritePolicy
from kvstore.byte_arena import ByteArena
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from client.kv_client import Key, KVClient

WRITE_SPARE_BYTES = 64 << 20  # parity and padded tails of one put_batch are encoded here


class BlockWrites:
    """A client's writes (its ``writes``): what :meth:`KVClient.put_batch` does."""

    def __init__(self, client: KVClient) -> None:
        self.c = client
        self.spare = ByteArena(WRITE_SPARE_BYTES)
        self.background: set[asyncio.Task[Any]] = set()  # shard puts a put returned before

    async def put_batch(
        self,
        keys: Sequence[Key],
        blocks: Sequence[Buffer],
        traffic_class: str,
        ttl_s: float | None,
        timeout_s: float | None,
    ) -> None:
        """:meth:`KVClient.put_batch`: misuse raised before anything is sent."""
        c = self.c
        if len(keys) != len(blocks):
            raise InvalidArgument(
                f"put_batch got {len(keys)} keys but {len(blocks)} blocks; pass one block per key"
            )
        keys = [as_key(key) for key in keys]
        c.config.ttl.classes.check(traffic_class)
        own_ttl_s = own_ttl(ttl_s)
        views = [self.block_view(block) for block in blocks]
        if c.sealer is not None:  # sealed before erasure coding (client/sealer.py)
            views = [memoryview(c.sealer.seal(k, v)) for k, v in zip(keys, views, strict=True)]
        if not keys:
            return
        groups = [c.placement.group_index(key) for key in keys]

        def on_short(positions: list[int]) -> None:
            for position in positions:
                c.follow_ups.hint_repair(groups[position], keys[position])

        write = BatchWrite(
            c.codec,
            c.conn_list,
            c.group_members,
            self.policy(),
            self.spare,
            c.write_counters,
            self.background,
            on_short,
            c.integrity,
        )
        timeout_s = c.resolve_timeout_s(timeout_s)
        await write.run(keys, groups, views, traffic_class, timeout_s, c.clock.now(), own_ttl_s)

    def policy(self) -> WritePolicy:
        """When a write returns, from the cluster's [client] section and codec."""
        config = self.c.config
        return WritePolicy(
            quorum=config.client.write_quorum,
            min_shards=config.min_write_shards,
            hedge_delay_s=config.client.hedge_delay_s,
            k=config.codec.k,
        )

    def block_view(self, data: Buffer) -> memoryview:
        """``data`` as bytes, if it is a block this cluster takes (room for the seal too)."""
        view = byte_view(data, "put data")
        max_bytes = self.c.config.codec.max_block_bytes - (OVERHEAD_BYTES if self.c.sealer else 0)
        if not 0 < len(view) <= max_bytes:
            raise InvalidArgument(
                f"a block must be 1 to {max_bytes} bytes (max_block_bytes in cluster.toml), "
                f"got {len(view)} bytes; split larger data into several blocks"
            )
        return view

    async def settle(self) -> None:
        """Wait for the shard puts still running in the background."""
        await asyncio.gather(*self.background, return_exceptions=True)


def own_ttl(ttl_s: float | None) -> float:
    """A put's own TTL as the request carries it (0 = the class's); misuse raised."""
    if ttl_s is None:
        return 0.0
    if not isinstance(ttl_s, int | float) or not ttl_s > 0:
        raise InvalidArgument(f"ttl_s must be a number of seconds above 0 (or None), got {ttl_s!r}")
    return float(ttl_s)
