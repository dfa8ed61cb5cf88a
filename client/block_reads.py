"""The read commands of :class:`~client.kv_client.KVClient`: batches of blocks from their
groups, landed in the caller's buffers or returned as bytes, opened when sealed, and read
again from the placement before a map change when the current one misses them.

The batch itself (one request per node, hedging, decoding) is client/batch_read.py; this
module decides which batch reads run and what the caller gets back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from client.batch_read import BatchRead, OnLanded
from client.buffers import Buffer, writable_view
from client.integrity import XXH3_CHECK
from client.keys import as_key
from client.read_outcome import BatchResult, check_on_timeout, raise_timeouts
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from client.kv_client import Key, KVClient

DECODE_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Landing:
    """What :meth:`KVClient.land_batch` did, per key of the batch."""

    landed: list[bool]  # the block is in its buffer, verified
    rewritten: list[bool]  # bytes were written after on_landed announced them: copy again
    timed_out: list[bool]  # not landed because the deadline passed before it was decided

    @classmethod
    def nothing(cls, num_blocks: int, timed_out: bool = False) -> Landing:
        """No block landed: a read that was not made (``timed_out``: for want of time) or
        that failed."""
        return cls([False] * num_blocks, [False] * num_blocks, [timed_out] * num_blocks)


class BlockReads:
    """A client's reads (its ``reads``): what :meth:`KVClient.get_batch` and
    :meth:`KVClient.land_batch` do, on the client's current map."""

    def __init__(self, client: KVClient) -> None:
        self.c = client
        # Batch decodes (a block checksum pass each, and any parity rebuild) run here.
        self.decode_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="kv-decode")

    async def get_batch(
        self, keys: Sequence[Key], timeout_s: float | None, on_timeout: str, outcomes: bool
    ) -> list[bytes | None] | BatchResult:
        """:meth:`KVClient.get_batch`: the blocks as bytes, or their outcomes."""
        check_on_timeout(on_timeout)
        read, timed_out = await self.read(keys, [None] * len(keys), timeout_s)
        blocks = [b if b is None or isinstance(b, bytes) else bytes(b) for b in read]
        result = BatchResult.of(blocks, timed_out)
        if on_timeout == "raise":
            raise_timeouts(keys, result, self.c.resolve_timeout_s(timeout_s))
        return result if outcomes else result.blocks

    async def land_batch(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffer],
        on_landed: OnLanded | None,
        timeout_s: float | None,
        on_timeout: str,
    ) -> Landing:
        """:meth:`KVClient.land_batch`: each block in its buffer, announced as it lands."""
        if len(keys) != len(buffers):
            raise InvalidArgument(
                f"get_batch_into got {len(keys)} keys but {len(buffers)} buffers; "
                "pass one buffer per key"
            )
        check_on_timeout(on_timeout)
        outs = [writable_view(buffer, f"buffer {i}") for i, buffer in enumerate(buffers)]
        rewritten: set[int] = set()
        blocks, timed_out = await self.read(keys, outs, timeout_s, on_landed, rewritten)
        if on_timeout == "raise":
            landed = [None if b is None else b"" for b in blocks]  # Timeout carries no buffers
            timeout_s = self.c.resolve_timeout_s(timeout_s)
            raise_timeouts(keys, BatchResult.of(landed, timed_out), timeout_s)
        return Landing(
            [block is not None for block in blocks],
            [i in rewritten for i in range(len(blocks))],
            timed_out,
        )

    async def read(
        self,
        keys: Sequence[Key],
        outs: Sequence[memoryview | None],
        timeout_s: float | None,
        on_landed: OnLanded | None = None,
        rewritten: set[int] | None = None,
    ) -> tuple[list[bytes | memoryview | None], list[bool]]:
        """The blocks, and per key whether the deadline passed before it was decided."""
        keys = [as_key(key) for key in keys]
        if not keys:
            return [], []
        c = self.c
        read = self.batch_read(c.group_members)
        groups = [c.placement.group_index(key) for key in keys]
        if c.sealer is None:
            placed = await self.read_placed(read, keys, groups, outs, timeout_s, on_landed)
            if rewritten is not None:
                rewritten.update(read.rewritten)
            return placed
        # A sealed block decodes into its own buffer; opening it writes the caller's.
        sealed, timed_out = await self.read_placed(
            read, keys, groups, [None] * len(keys), timeout_s
        )
        opened = [
            None if block is None else c.sealer.open(key, block, out)
            for key, block, out in zip(keys, sealed, outs, strict=True)
        ]
        return opened, timed_out

    def batch_read(self, group_members: Sequence[Sequence[int]]) -> BatchRead:
        """One batch read over ``group_members`` (node indexes of each group)."""
        c = self.c
        return BatchRead(
            c.codec,
            c.conn_list,
            c.readers,
            group_members,
            c.config.client.read_fanout,
            min(n.max_batch_bytes for n in c.config.nodes),
            c.read_counters,
            c.config.client.hedge_delay_s,
            c.follow_ups,
            decode_pool=self.decode_pool,
            landing_pool=c.landing_pool,
            times=c.read_times,
            block_check=c.integrity or XXH3_CHECK,
            timeline=c.timeline,
        )

    async def read_placed(
        self,
        read: BatchRead,
        keys: Sequence[bytes],
        groups: list[int],
        outs: Sequence[memoryview | None],
        timeout_s: float | None,
        on_landed: OnLanded | None = None,
    ) -> tuple[list[bytes | memoryview | None], list[bool]]:
        """The blocks from the current placement, and which keys timed out, within one
        deadline. Two kinds of miss are read once more, within what is left of it (their
        blocks then count as rewritten: no shard of a second read is announced):

        - a key whose shards failed their block check after the nodes' own checks and left
          fewer than k (bytes changed in memory or on a link): again from the same nodes,
          whose read stopped at the first k answers;
        - during a map change, a key whose group changed: from the placement before it.
        """
        config = self.c.config
        loop = asyncio.get_running_loop()
        timeout_s = self.c.resolve_timeout_s(timeout_s)
        deadline_s = loop.time() + timeout_s
        blocks = await read.run(keys, groups, outs, timeout_s, on_landed)
        timed_out = list(read.timed_out)

        async def read_again(second: BatchRead, positions: list[int]) -> None:
            found = await second.run(
                [keys[i] for i in positions],
                [groups[i] for i in positions],
                [outs[i] for i in positions],
                max(0.0, deadline_s - loop.time()),
            )
            for i, block, late in zip(positions, found, second.timed_out, strict=True):
                blocks[i], timed_out[i] = block, block is None and (late or timed_out[i])
                read.rewritten.add(i)

        corrupt = sorted(i for i in read.corrupt_misses if blocks[i] is None)
        if corrupt:
            await read_again(self.batch_read(read.group_members), corrupt)
        previous = config.moving_from
        again = [
            i
            for i, block in enumerate(blocks)
            if block is None and previous and previous[groups[i]] != config.groups[groups[i]]
        ]
        if again:
            await read_again(self.batch_read(self.c.previous_members), again)
        return blocks, timed_out

    def close(self) -> None:
        self.decode_pool.shutdown(wait=False)
