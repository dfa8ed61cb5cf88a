"""The batch write: every block encoded, one PutShards per node per batch, done per key at the
write quorum, or degraded at min_write_shards.

::

    blocks -> encode_into (data payloads view the caller's blocks; parity and padded tails
              in one reused arena region) -> per node ONE request with the shard it holds of
              every key of the batch (encoded with one copy of each shard and the batch's
              write time, client/node_conn.py)
           -> every node of each key's group at once, each request retried on transient
              errors while a key still waits on it (within the deadline, and at most
              RETRY_WINDOW_S): each retry dials a node that could not be reached afresh
              (NodeConn.put_until), so a node that just came back takes it
           -> a key is decided when it has write_quorum (11) shards stored; or when it has
              min_write_shards (10, = k) and hedge_delay_s passed since every key of the
              batch had that many, or only nodes that just failed are still pending for it
              (degraded: the missing shards are hinted to repair); or when it cannot reach
              min_write_shards any more (QuorumError names it)
           -> every key decided -> return; the requests still in flight finish in the
              background (bounded by the deadline), and one that fails hints its keys too

Every put goes to all k+m nodes, a node that failed recently too: a restarted node takes the
next write as soon as it answers, and a dead one fails fast (a hung one costs the hedge delay).

Degraded writes, not hinted handoff (docs/operations.md, "Repair"): with two nodes of a group down a
put succeeds with k shards on the k nodes that are up, and the group's leader rebuilds the two
missing shards on their owners once they are back. Handing the shards to other nodes instead would
keep 12 shards, but in a group that spans every node (12 nodes, groups of 12) the only other nodes
already hold a shard of the block, so a node holding two would make its loss cost two shards: no
redundancy gained for the extra bookkeeping, reads of misplaced shards, and the move back.

A node stores its request all or nothing (one index transaction), so a key counts one shard
stored per node whose request succeeded. A key that fails stored fewer than k shards, so it is
never readable: the error says how many landed where, and that the nodes that stored one
retired the key's older version. The node commits concurrent requests together
(kvstore/store/group_commit.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from client.integrity import BlockIntegrity
from client.node_conn import NodeConn, consume_result
from erasure.codec import Codec
from kvstore.byte_arena import ByteArena
from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    QuorumError,
)
from kvstore.wire.put_request import encode_put_request

_VERSION = slice(20, 36)  # the block checksum in a shard header (erasure/shard.py)


@dataclass
class WriteCounters:
    num_puts: int = 0  # blocks written (a batch of n blocks counts n)
    num_put_batches: int = 0
    num_put_requests: int = 0  # PutShards sent (one per node per batch, usually)
    num_put_retries: int = 0  # requests retried after a transient error
    num_quorum_failures: int = 0  # blocks below min_write_shards
    num_degraded_puts: int = 0  # blocks left with fewer than k+m shards (repair hinted)


@dataclass(frozen=True)
class WritePolicy:
    """When a write returns (kvstore/config.py ClientConfig)."""

    quorum: int  # write_quorum: return at once with this many shards of a key stored
    min_shards: int  # min_write_shards: below it a key fails
    hedge_delay_s: float  # how long keys at min_shards wait for more
    k: int  # shards a read needs


class BatchWrite:
    """One batch write (see module doc). Use once: ``await run()``.

    ``on_short(positions)`` is called (now, or when a request left running in the background
    fails) with the batch positions of keys that were stored but with fewer than k+m shards:
    the caller hints their repair. Each position is reported at most once.
    """

    def __init__(
        self,
        codec: Codec,
        conns: Sequence[NodeConn],
        group_members: Sequence[Sequence[int]],
        policy: WritePolicy,
        arena: ByteArena,
        counters: WriteCounters,
        background: set[asyncio.Task[Any]],
        on_short: Callable[[list[int]], None] = lambda positions: None,
        integrity: BlockIntegrity | None = None,
    ) -> None:
        self.codec = codec
        self.conns = conns
        self.group_members = group_members
        self.policy = policy
        self.arena = arena
        self.counters = counters
        self.background = background
        self._on_short = on_short
        self.integrity = integrity  # keyed block versions (client/integrity.py), or xxh3
        self._reported: set[int] = set()
        self._versions: list[bytes] = []
        self._decided = False  # every key decided: requests still failing stop retrying

    async def run(
        self,
        keys: Sequence[bytes],
        groups: Sequence[int],
        blocks: Sequence[memoryview],
        traffic_class: str,
        timeout_s: float,
        written_at_s: float = 0.0,
        ttl_s: float = 0.0,
    ) -> None:
        deadline_s = time.monotonic() + timeout_s
        self.counters.num_put_batches += 1
        self.counters.num_puts += len(keys)
        requests = self._requests(keys, groups, blocks, traffic_class, written_at_s, ttl_s)
        tasks = {
            asyncio.ensure_future(
                self.conns[node].put_until(request, deadline_s, self.counters, self._undecided)
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
        written_at_s: float,
        ttl_s: float,
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
                keyed = self.integrity.version(key, block) if self.integrity else None
                shards = codec.encode_into(
                    block, spare.view[start : start + size], keyed_version=keyed
                )
                start += size
                self._versions.append(bytes(memoryview(shards[0][0])[_VERSION]))
                for shard_index, node in enumerate(self.group_members[group]):
                    node_to_items.setdefault(node, []).append((key, shards[shard_index]))
                    node_to_positions.setdefault(node, []).append(position)
            requests = []
            for node, items in node_to_items.items():
                conn = self.conns[node]
                positions = node_to_positions[node]
                for start, end in _spans([len(h) + len(p) for _, (h, p) in items], conn):
                    request = encode_put_request(
                        conn.tenant, traffic_class, items[start:end], written_at_s, ttl_s
                    )
                    requests.append((node, request, positions[start:end]))
            return requests
        finally:
            spare.release()

    async def _until_decided(
        self, keys: Sequence[bytes], tasks: dict[asyncio.Future[None], tuple[int, list[int]]]
    ) -> None:
        """Wait until every key is decided (module docstring); raise for those that failed."""
        policy = self.policy
        state = _KeyStates(len(keys))
        for node, positions in tasks.values():
            for position in positions:
                state.pending[position].add(node)
        hedge_at_s: float | None = None
        errors: dict[int, BaseException] = {}
        while tasks and not state.all_decided(policy, hedge_at_s, self._is_suspect):
            timeout_s = None if hedge_at_s is None else max(0.0, hedge_at_s - time.monotonic())
            done, _ = await asyncio.wait(
                tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                node, positions = tasks.pop(task)
                if (exc := task.exception()) is not None:
                    errors[node] = exc
                state.record(node, positions, exc is None)
            if hedge_at_s is None and state.all_at_min(policy):
                hedge_at_s = time.monotonic() + policy.hedge_delay_s
        self._decided = True
        failed = [i for i, nodes in enumerate(state.stored) if len(nodes) < policy.min_shards]
        failed_set = set(failed)
        short = [i for i in range(len(keys)) if state.failed[i] and i not in failed_set]
        self._report_short(short)
        for task, (_, positions) in tasks.items():  # decided: the rest in the background
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            task.add_done_callback(consume_result)
            kept = [p for p in positions if p not in failed_set]
            task.add_done_callback(lambda t, kept=kept: self._on_background_done(t, kept))
        if failed:
            self.counters.num_quorum_failures += len(failed)
            raise self._quorum_error(keys, failed, state, errors)

    def _undecided(self) -> bool:
        return not self._decided

    def _is_suspect(self, node: int) -> bool:
        return self.conns[node].is_suspect()

    def _on_background_done(self, task: asyncio.Future[None], positions: list[int]) -> None:
        if task.cancelled() or task.exception() is not None:
            self._report_short(positions)

    def _report_short(self, positions: list[int]) -> None:
        new = [p for p in positions if p not in self._reported]
        if new:
            self._reported.update(new)
            self.counters.num_degraded_puts += len(new)
            self._on_short(new)

    def _quorum_error(
        self,
        keys: Sequence[bytes],
        failed: list[int],
        state: _KeyStates,
        errors: dict[int, BaseException],
    ) -> KVStoreError:
        """Misuse (bad argument, bad token) surfaces as itself; anything else is a QuorumError
        that says exactly what each failed key left behind (:func:`quorum_message`)."""
        for exc in errors.values():
            if isinstance(exc, InvalidArgument | PermissionDenied):
                return exc

        def names(nodes: set[int]) -> list[str]:
            return sorted(self.conns[n].node_id for n in nodes)

        outcomes = [
            KeyOutcome(
                keys[i],
                self._versions[i],
                names(state.stored[i]),
                names(state.failed[i]),
                names(state.pending[i]),
            )
            for i in failed
        ]
        node_errors = {self.conns[n].node_id: str(e) for n, e in errors.items()}
        error = QuorumError(quorum_message(outcomes, len(keys), self.policy, node_errors))
        error.keys = [keys[i] for i in failed]  # type: ignore[attr-defined]
        return error


@dataclass(frozen=True)
class KeyOutcome:
    """Where one key's shards stand when its put is decided: node ids that stored one, failed,
    or are still in flight."""

    key: bytes
    version: bytes
    stored: list[str]
    failed: list[str]
    pending: list[str]


MAX_NAMED_KEYS = 4
MAX_NAMED_NODES = 12


def quorum_message(
    outcomes: Sequence[KeyOutcome],
    num_keys: int,
    policy: WritePolicy,
    node_errors: dict[str, str],
) -> str:
    """The QuorumError text: per failed key how many shards landed where, whether that is
    readable (and what it would take), every failed node with its error (or how many are
    left out), and what to do."""
    details = [_key_detail(o, policy.k) for o in outcomes[:MAX_NAMED_KEYS]]
    if len(outcomes) > MAX_NAMED_KEYS:
        details.append(f"and {len(outcomes) - MAX_NAMED_KEYS} more keys")
    failed_nodes = sorted(node_errors)
    named = "; ".join(f"{n}: {node_errors[n]}" for n in failed_nodes[:MAX_NAMED_NODES]) or "none"
    if len(failed_nodes) > MAX_NAMED_NODES:
        named += f"; and {len(failed_nodes) - MAX_NAMED_NODES} more failed nodes not named"
    return (
        f"{len(outcomes)} of {num_keys} blocks are below min_write_shards {policy.min_shards}: "
        f"{'; '.join(details)}. The stored shards stay until their TTL, and each node that "
        f"stored one retired the key's older version there. Failed nodes "
        f"({len(failed_nodes)}): {named}. Those blocks are not stored (the others are); retry "
        "them when the nodes are back"
    )


def _key_detail(outcome: KeyOutcome, k: int) -> str:
    num_stored, num_pending = len(outcome.stored), len(outcome.pending)
    num_shards = num_stored + len(outcome.failed) + num_pending
    on = ", ".join(outcome.stored) or "no node"
    if num_stored >= k:
        readable = f"{k} or more, so it IS readable (repair completes it)"
    elif num_stored + num_pending >= k:
        readable = (
            f"fewer than the {k} a read needs, so it is not readable unless {k - num_stored} "
            f"of the {num_pending} puts still in flight ({', '.join(outcome.pending)}) land"
        )
    elif num_pending:
        readable = (
            f"fewer than the {k} a read needs, and the {num_pending} puts still in flight "
            f"({', '.join(outcome.pending)}) cannot make it readable"
        )
    else:
        readable = f"fewer than the {k} a read needs, so it is not readable"
    failed = f"; failed on {', '.join(outcome.failed)}" if outcome.failed else ""
    return (
        f"key {outcome.key.hex()} stored {num_stored} of {num_shards} shards of version "
        f"{outcome.version.hex()} (on {on}){failed}: {readable}"
    )


class _KeyStates:
    """Per batch position: the nodes that stored its shard, failed it, or are still pending."""

    def __init__(self, num_keys: int) -> None:
        self.stored: list[set[int]] = [set() for _ in range(num_keys)]
        self.failed: list[set[int]] = [set() for _ in range(num_keys)]
        self.pending: list[set[int]] = [set() for _ in range(num_keys)]

    def record(self, node: int, positions: list[int], ok: bool) -> None:
        outcome = self.stored if ok else self.failed
        for position in positions:
            self.pending[position].discard(node)
            outcome[position].add(node)

    def all_at_min(self, policy: WritePolicy) -> bool:
        """Every key has min_shards stored or can no longer get them (the hedge starts)."""
        return all(
            len(stored) >= policy.min_shards or len(stored) + len(pending) < policy.min_shards
            for stored, pending in zip(self.stored, self.pending, strict=True)
        )

    def all_decided(
        self, policy: WritePolicy, hedge_at_s: float | None, is_suspect: Callable[[int], bool]
    ) -> bool:
        hedged = hedge_at_s is not None and time.monotonic() >= hedge_at_s
        for stored, pending in zip(self.stored, self.pending, strict=True):
            if len(stored) >= policy.quorum or not pending:
                continue
            if len(stored) + len(pending) < policy.min_shards:
                continue  # fails: no need to wait for it
            if len(stored) >= policy.min_shards and (hedged or all(map(is_suspect, pending))):
                continue  # degraded: waiting on nodes that just failed buys nothing
            return False
        return True


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
