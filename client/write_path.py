"""The quorum write of one block: shard i to group node i, all at once, done at the quorum.

::

    encode -> 12 shards -> PutShards(shard i) to node i, concurrently, each with retries
              successes reach write_quorum  -> return; stragglers finish in the background
              failures make the quorum unreachable -> cancel the rest, raise QuorumError

A write below the quorum is reported as failed, but shards it did store stay on their nodes:
they carry the block's version, so a reader never combines them with another version's shards,
and with fewer than k of them the block simply reads as a miss.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client.node_conn import NodeConn, consume_result
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
    num_puts: int = 0
    num_put_retries: int = 0  # shard puts retried after a transient error
    num_quorum_failures: int = 0


def write_targets(suspect: Sequence[bool], quorum: int) -> list[int]:
    """Group positions to send shards to: skip suspect nodes unless the quorum needs them."""
    healthy = [i for i, is_suspect in enumerate(suspect) if not is_suspect]
    return healthy if len(healthy) >= quorum else list(range(len(suspect)))


async def put_with_retries(
    conn: NodeConn,
    key: bytes,
    shard: bytes,
    traffic_class: str,
    deadline_s: float,
    counters: WriteCounters,
) -> None:
    """One shard put, retried with exponential backoff on transient errors until the deadline."""
    for attempt in range(PUT_ATTEMPTS):
        try:
            await conn.put_shard(key, shard, traffic_class, deadline_s - time.monotonic())
            return
        except KVStoreError as exc:
            backoff_s = FIRST_BACKOFF_S * 4**attempt
            retryable = isinstance(exc, RETRYABLE) and attempt + 1 < PUT_ATTEMPTS
            if not retryable or time.monotonic() + backoff_s >= deadline_s:
                raise
        counters.num_put_retries += 1
        await asyncio.sleep(backoff_s)


async def write_block(
    conns: Sequence[NodeConn],
    key: bytes,
    shards: Sequence[bytes],
    traffic_class: str,
    quorum: int,
    timeout_s: float,
    counters: WriteCounters,
    background: set[asyncio.Task[Any]],
) -> None:
    """Put ``shards[i]`` on ``conns[i]``; return at ``quorum`` successes, else raise.

    Puts still in flight at the quorum keep running in ``background`` (bounded by the deadline).
    """
    deadline_s = time.monotonic() + timeout_s
    targets = write_targets([conn.is_suspect() for conn in conns], quorum)
    tasks = {
        asyncio.ensure_future(
            put_with_retries(conns[i], key, shards[i], traffic_class, deadline_s, counters)
        ): i
        for i in targets
    }
    num_stored, position_to_error = 0, {}
    num_skipped = len(conns) - len(targets)
    while tasks:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            position = tasks.pop(task)
            if task.exception() is None:
                num_stored += 1
            else:
                position_to_error[position] = task.exception()
        if num_stored >= quorum:
            _to_background(tasks, background)
            return
        if len(conns) - num_skipped - len(position_to_error) < quorum:
            _cancel(tasks)
            break
    counters.num_quorum_failures += 1
    skipped = [conns[i].node_id for i in range(len(conns)) if i not in targets]
    raise _quorum_error(conns, num_stored, quorum, position_to_error, skipped)


def _quorum_error(
    conns: Sequence[NodeConn],
    num_stored: int,
    quorum: int,
    position_to_error: dict[int, Any],
    skipped: list[str],
) -> KVStoreError:
    """Misuse (bad argument, bad token) surfaces as itself; anything else is a QuorumError."""
    for exc in position_to_error.values():
        if isinstance(exc, InvalidArgument | PermissionDenied):
            return exc
    failed = ", ".join(f"{conns[i].node_id} ({exc})" for i, exc in position_to_error.items())
    return QuorumError(
        f"put stored {num_stored} of {len(conns)} shards but the write quorum is {quorum}; "
        f"failed: {failed or 'none'}; skipped as recently failed: {', '.join(skipped) or 'none'}. "
        "The block is not stored; retry the put when the nodes are back"
    )


def _to_background(tasks: dict[asyncio.Task[Any], int], background: set[asyncio.Task[Any]]) -> None:
    for task in tasks:
        background.add(task)
        task.add_done_callback(background.discard)
        task.add_done_callback(consume_result)


def _cancel(tasks: dict[asyncio.Task[Any], int]) -> None:
    for task in tasks:
        task.cancel()
        task.add_done_callback(consume_result)
