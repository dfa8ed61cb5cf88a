"""The batch write: every block encoded, one PutShards per node per batch, done at the quorum.

::

    blocks -> encode_into (data payloads view the caller's blocks; parity and padded tails
              in one reused arena region) -> per node ONE request with the shard it holds of
              every key of the batch (encoded with one copy of each shard, client/node_conn.py)
           -> all nodes at once, each request retried on transient errors until the deadline
           -> every key reaches write_quorum successes -> return; stragglers finish in the
              background;  some keys cannot -> wait for the rest, raise QuorumError naming them

A node stores its request all or nothing (one index transaction), so a key counts one shard
stored per node whose request succeeded. Shards stored for a key below the quorum stay on
their nodes: they carry the block's version, so a reader never combines them with another
version's shards, and with fewer than k of them the block reads as a miss. The node commits
concurrent requests together (kvstore/group_commit.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client.node_conn import NodeConn, consume_result, encode_put_request
from erasure.codec import Codec
from kvstore.byte_arena import ByteArena
from kvstore.errors import (
    RETRYABLE,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    QuorumError,
)

PUT_ATTEMPTS = 3
FIRST_BACKOFF_S = 0.01  # then x4 per attempt


@dataclass
class WriteCounters:
    num_puts: int = 0  # blocks written (a batch of n blocks counts n)
    num_put_batches: int = 0
    num_put_requests: int = 0  # PutShards sent (one per node per batch, usually)
    num_put_retries: int = 0  # requests retried after a transient error
    num_quorum_failures: int = 0  # blocks that missed the write quorum


def write_targets(suspect: Sequence[bool], quorum: int) -> list[int]:
    """Group positions to send shards to: skip suspect nodes unless the quorum needs them."""
    healthy = [i for i, is_suspect in enumerate(suspect) if not is_suspect]
    return healthy if len(healthy) >= quorum else list(range(len(suspect)))


async def put_with_retries(
    conn: NodeConn, request: bytes, deadline_s: float, counters: WriteCounters
) -> None:
    """One encoded PutShards, retried with exponential backoff on transient errors until the
    deadline."""
    for attempt in range(PUT_ATTEMPTS):
        try:
            await conn.put_encoded(request, deadline_s - time.monotonic())
            return
        except KVStoreError as exc:
            backoff_s = FIRST_BACKOFF_S * 4**attempt
            retryable = isinstance(exc, RETRYABLE) and attempt + 1 < PUT_ATTEMPTS
            if not retryable or time.monotonic() + backoff_s >= deadline_s:
                raise
        counters.num_put_retries += 1
        await asyncio.sleep(backoff_s)


class BatchWrite:
    """One batch write (see module doc). Use once: ``await run()``."""

    def __init__(
        self,
        codec: Codec,
        conns: Sequence[NodeConn],
        group_members: Sequence[Sequence[int]],
        quorum: int,
        arena: ByteArena,
        counters: WriteCounters,
        background: set[asyncio.Task[Any]],
    ) -> None:
        self.codec = codec
        self.conns = conns
        self.group_members = group_members
        self.quorum = quorum
        self.arena = arena
        self.counters = counters
        self.background = background

    async def run(
        self,
        keys: Sequence[bytes],
        groups: Sequence[int],
        blocks: Sequence[memoryview],
        traffic_class: str,
        timeout_s: float,
    ) -> None:
        deadline_s = time.monotonic() + timeout_s
        self.counters.num_put_batches += 1
        self.counters.num_puts += len(keys)
        requests = self._requests(keys, groups, blocks, traffic_class)
        tasks = {
            asyncio.ensure_future(
                put_with_retries(self.conns[node], request, deadline_s, self.counters)
            ): (node, positions)
            for node, request, positions in requests
        }
        self.counters.num_put_requests += len(tasks)
        await self._until_decided(keys, tasks)

    def _requests(
        self,
        keys: Sequence[bytes],
        groups: Sequence[int],
        blocks: Sequence[memoryview],
        traffic_class: str,
    ) -> list[tuple[int, bytes, list[int]]]:
        """(node, its encoded PutShards request, the batch positions it stores) per request:
        one per node, more where a node's shards pass half its max_batch_bytes.

        The requests are encoded (one copy of each shard) before this returns, so the arena
        region holding parity and padded tails is released at once.
        """
        codec = self.codec
        spare = self.arena.take(sum(codec.spare_bytes(len(b)) for b in blocks))
        node_to_items: dict[int, list[tuple[bytes, Any]]] = {}
        node_to_positions: dict[int, list[int]] = {}
        try:
            start = 0
            for position, (key, group, block) in enumerate(zip(keys, groups, blocks, strict=True)):
                size = codec.spare_bytes(len(block))
                shards = codec.encode_into(block, spare.view[start : start + size])
                start += size
                members = self.group_members[group]
                suspect = [self.conns[n].is_suspect() for n in members]
                for shard_index in write_targets(suspect, self.quorum):
                    node = members[shard_index]
                    node_to_items.setdefault(node, []).append((key, shards[shard_index]))
                    node_to_positions.setdefault(node, []).append(position)
            requests = []
            for node, items in node_to_items.items():
                conn = self.conns[node]
                positions = node_to_positions[node]
                for start, end in _spans([len(h) + len(p) for _, (h, p) in items], conn):
                    request = encode_put_request(conn.tenant, traffic_class, items[start:end])
                    requests.append((node, request, positions[start:end]))
            return requests
        finally:
            spare.release()

    async def _until_decided(
        self, keys: Sequence[bytes], tasks: dict[asyncio.Future[None], tuple[int, list[int]]]
    ) -> None:
        """Wait until every key reached the quorum or cannot; raise for those that cannot."""
        num_targets = [0] * len(keys)
        for _, positions in tasks.values():
            for position in positions:
                num_targets[position] += 1
        num_stored, num_failed = [0] * len(keys), [0] * len(keys)
        errors: dict[int, BaseException] = {}

        def undecided() -> bool:
            return any(
                stored < self.quorum <= targets - failed
                for stored, failed, targets in zip(num_stored, num_failed, num_targets, strict=True)
            )

        while tasks and undecided():
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                node, positions = tasks.pop(task)
                counts = num_stored if task.exception() is None else num_failed
                if task.exception() is not None:
                    errors[node] = task.exception()  # type: ignore[assignment]
                for position in positions:
                    counts[position] += 1
        for task in tasks:  # the quorum is decided for every key: the rest in the background
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            task.add_done_callback(consume_result)
        failed = [i for i, stored in enumerate(num_stored) if stored < self.quorum]
        if failed:
            self.counters.num_quorum_failures += len(failed)
            raise self._quorum_error(keys, failed, num_stored, errors)

    def _quorum_error(
        self,
        keys: Sequence[bytes],
        failed: list[int],
        num_stored: list[int],
        errors: dict[int, BaseException],
    ) -> KVStoreError:
        """Misuse (bad argument, bad token) surfaces as itself; anything else is a QuorumError."""
        for exc in errors.values():
            if isinstance(exc, InvalidArgument | PermissionDenied):
                return exc
        named = ", ".join(f"{keys[i].hex()} ({num_stored[i]} stored)" for i in failed[:8])
        more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
        causes = "; ".join(f"{self.conns[n].node_id}: {e}" for n, e in list(errors.items())[:4])
        error = QuorumError(
            f"{len(failed)} of {len(keys)} blocks are below the write quorum of {self.quorum} "
            f"shards: {named}{more}. Failed nodes: {causes or 'none'}. Those blocks are not "
            "stored (the others are); retry them when the nodes are back"
        )
        error.keys = [keys[i] for i in failed]  # type: ignore[attr-defined]
        return error


def _spans(shard_bytes: list[int], conn: NodeConn) -> list[tuple[int, int]]:
    """[start, end) runs of shards whose total stays within half the node's request limit."""
    limit = conn.max_batch_bytes // 2
    spans, start, total = [], 0, 0
    for end, size in enumerate(shard_bytes):
        if end > start and total + size > limit:
            spans.append((start, end))
            start, total = end, 0
        total += size
    spans.append((start, len(shard_bytes)))
    return spans
