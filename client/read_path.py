"""The hedged read of one block: ask ``fanout`` nodes, stop at ``k`` valid shards of one version.

::

    plan_read -> GetShards to the 11 planned nodes, concurrently
                   | each reply: verify every shard, group by version (ShardCollector)
                   | a version reaches k shards -> cancel the outstanding RPCs, decode
                   | the asked nodes can no longer give k -> ask the reserve nodes too
                   v
              decoded block (checksummed by the codec), or None (miss / too few shards)

For ``get_into`` over UCX each data shard's payload lands straight at its place in the
caller's buffer (client/ucx_gets.py, PayloadLanding); the read stops every such landing
before it decodes and before it returns, so only the decoder writes there afterwards.

This is the module's one dense hot path. Decoding runs on the event loop thread: it is a
fraction of a millisecond with ISA-L and spares a thread hop per block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client.node_conn import NodeConn
from client.read_plan import ReadPlan, plan_read
from client.shard_tally import ShardCollector, can_complete
from client.ucx_gets import PayloadLanding
from kvstore.errors import CodecError, InvalidArgument, KVStoreError, PermissionDenied
from kvstore.proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class ReadCounters:
    """What reads did, for tests and benchmarks (monotonic counts)."""

    num_reads: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_corrupt_shards: int = 0  # shards skipped: bad checksum/header, or CORRUPT from a node
    num_hedged: int = 0  # reads that finished without waiting for every asked node
    num_reserve_asks: int = 0  # reads that had to ask nodes beyond the first fan-out
    num_decode_failures: int = 0  # versions whose k shards did not rebuild a valid block


class BlockRead:
    """One read of one key from its group (see module doc). Use once: ``await run()``."""

    def __init__(
        self,
        conns: Sequence[NodeConn],
        codec: Any,
        fanout: int,
        key: bytes,
        collector: ShardCollector,
        counters: ReadCounters,
    ) -> None:
        self.conns = conns
        self.codec = codec
        self.fanout = fanout
        self.key = key
        self.collector = collector
        self.counters = counters
        self.pending: dict[asyncio.Future[Any], int] = {}  # future of a node's reply -> position
        self.landings: dict[int, PayloadLanding] = {}  # position -> its payload's place in out

    async def run(self, timeout_s: float, out: memoryview | None) -> bytes | memoryview | None:
        """The block's bytes (written into ``out`` when given), or None."""
        plan = self._plan()
        reserve = list(plan.reserve)
        self.landings = self._landings(out)
        self._ask(plan.ask, timeout_s)
        try:
            while self.pending:
                done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    for version in self._absorb(future, self.pending.pop(future)):
                        outstanding = self._outstanding()
                        # Payloads still on their way must not land in ``out`` once it holds
                        # the decoded block.
                        await self._close_landings()
                        block = self._decode(version, out)
                        if block is not None:
                            self._record_lateness(plan.ask, outstanding)
                            return block
                best = self.collector.best_count
                if reserve and not can_complete(best, len(self.pending), self.codec.k):
                    self.counters.num_reserve_asks += 1
                    self._ask(reserve, timeout_s)
                    reserve = []
                if not can_complete(best, len(self.pending), self.codec.k):
                    return None
            return None
        finally:
            self._cancel_outstanding()
            await self._close_landings()  # nothing writes into ``out`` after we return
            self.counters.num_corrupt_shards += self.collector.num_corrupt

    def _landings(self, out: memoryview | None) -> dict[int, PayloadLanding]:
        """Group position -> where its data shard's payload belongs in ``out`` (UCX only).

        Shard i of a block of len(out) bytes holds bytes [i*P, (i+1)*P); the zero-padded last
        data shard does not fit and lands elsewhere (client/ucx_gets.py).
        """
        if out is None or not any(conn.ucx is not None for conn in self.conns):
            return {}
        payload_len = self.codec.payload_bytes(len(out))
        return {
            i: PayloadLanding(out[i * payload_len : (i + 1) * payload_len], i)
            for i in range(self.codec.k)
            if payload_len and (i + 1) * payload_len <= len(out)
        }

    async def _close_landings(self) -> None:
        """Close every landing, to the end even if this read is cancelled meanwhile (a
        timeout): a receive left open could write into ``out`` after the read returned."""
        if self.landings:
            closes = asyncio.gather(*(landing.close() for landing in self.landings.values()))
            await _finish_despite_cancel(closes)

    def _plan(self) -> ReadPlan:
        now_suspect = [conn.is_suspect() for conn in self.conns]
        late_scores = [conn.health.late_score for conn in self.conns]
        probe = [conn.health.is_slow and conn.health.take_probe() for conn in self.conns]
        return plan_read(self.codec.k, self.fanout, now_suspect, late_scores, probe)

    def _ask(self, positions: Sequence[int], timeout_s: float) -> None:
        for position in positions:
            future = self.conns[position].get_shard(
                self.key, timeout_s, self.landings.get(position)
            )
            self.pending[future] = position

    def _absorb(self, future: asyncio.Future[Any], position: int) -> list[bytes]:
        """Take one node's reply; the versions it completed (k shards), in order."""
        try:
            result = future.result()
        except PermissionDenied:
            raise
        except KVStoreError as exc:
            log.debug("read from node %s failed: %s", self.conns[position].node_id, exc)
            return []
        if result.status == pb.CORRUPT:
            self.counters.num_corrupt_shards += 1
        completed = (self.collector.add(shard) for shard in result.shards)
        return [version for version in completed if version is not None]

    def _decode(self, version: bytes, out: memoryview | None) -> bytes | memoryview | None:
        block_len = self.collector.version_to_header[version].block_len
        if out is not None and len(out) != block_len:
            raise InvalidArgument(
                f"get_into buffer is {len(out)} bytes but the block is {block_len} bytes; "
                "pass a writable buffer of exactly the block's size"
            )
        try:
            # The collector ran codec.verify on every shard as it arrived.
            return self.codec.decode(self.collector.shards(version), out=out, verified=True)
        except CodecError as exc:
            log.warning("dropping version %s: %s", version.hex(), exc)
            self.counters.num_decode_failures += 1
            self.collector.drop(version)
            return None

    def _outstanding(self) -> set[int]:
        """Positions asked whose reply has not come."""
        return {p for future, p in self.pending.items() if not future.done()}

    def _record_lateness(self, asked: Sequence[int], outstanding: set[int]) -> None:
        if outstanding:
            self.counters.num_hedged += 1
        for position in asked:
            self.conns[position].health.record_lateness(position in outstanding)

    def _cancel_outstanding(self) -> None:
        """Cancel the replies still awaited; retrieve the errors of those already in (a
        refusal raised by one reply must not leave its siblings' errors unretrieved)."""
        for future in self.pending:
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()
        self.pending.clear()


async def _finish_despite_cancel(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` to finish; a cancel of this task meanwhile is raised after that."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            cancelled = exc
    future.result()
    if cancelled is not None:
        raise cancelled
