"""The checks and decoding of a batch read (client/batch_read.py): a block is verified as soon
as every data shard of its version lies in its buffer (in the decode pool, while the read goes
on), and at the end every complete key is decoded into its buffer, the block checksum
verified: one pass over every byte. Only when it fails are the shards' own checksums checked,
to find the bad one: it is dropped and counted, and the block decoded again from the others
(parity) or reported a miss.

Decoding runs on the event loop thread, or for batches of DECODE_POOL_MIN_BYTES and more in the
client's decode pool: with ISA-L and every data shard in place it is one xxh3 pass over the
block. A block in a landing pool slot that a late node may still write (client/landing_pool.py
``is_tainted``) is a miss.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import numpy as np

from client.node_conn import finish_despite_cancel
from client.read_timeline import CLIENT, ReadTimeline
from client.shard_table import ShardTable
from erasure.shard import SplitShard, shard_payload
from kvstore.errors import CodecError, InvalidArgument

if TYPE_CHECKING:
    from client.batch_read import BatchRead

log = logging.getLogger(__name__)

DECODE_POOL_MIN_BYTES = 1 << 20  # smaller batches decode on the event loop (no thread hop)


class BlockChecks:
    """The block checks and the decoding of one batch read's state (client/batch_read.py
    ``_State`` derives from it): what it reads of the state is declared here."""

    read: BatchRead
    keys: Sequence[bytes]
    outs: Sequence[memoryview | None]
    k: int
    table: ShardTable
    complete: list[bytes | None]  # per key, the version that reached k shards
    verified: dict[int, bool]  # positions checked early (False until the check said so)
    rewritten: set[int]
    corrupt_misses: set[int]  # positions whose shards failed their block and left too few
    pool_offsets: list[int | None] | None
    num_in_place: np.ndarray  # per key, data shards that landed at their place (any version)
    _checks: list[asyncio.Future[None]]

    def timed_out(self) -> list[bool]:
        """Per key: the deadline passed before it was decided (the state defines it)."""
        raise NotImplementedError

    def _check_whole(self, positions: list[int]) -> None:
        """Start the block check of the keys just completed whose data shards all lie at
        their place already: no node may still write there (each data range has one writer,
        and it answered), so the check overlaps the rest of the read. One native call for the
        lot, in the decode pool."""
        pool = self.read.decode_pool
        whole = [
            (position, self.complete[position], out)
            for position in positions
            if (out := self.outs[position]) is not None and self._whole(position)
        ]
        if pool is None or not whole:
            return
        keys = [self.keys[position] for position, _, _ in whole]
        outs = [out for _, _, out in whole]
        versions = [version for _, version, _ in whole]
        check = functools.partial(self.read.block_check.verify, keys, outs, versions)
        if self.read.timeline is not None:
            check = functools.partial(_timed, self.read.timeline, "check", check)
        future = asyncio.get_running_loop().run_in_executor(pool, check)
        for position, _, _ in whole:
            self.verified[position] = False  # until the check says otherwise

        def record(done: asyncio.Future[list[bool]]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            for (position, _, _), ok in zip(whole, done.result(), strict=True):
                self.verified[position] = ok

        future.add_done_callback(record)
        self._checks.append(future)

    def _data_shards(self, position: int, version: bytes) -> int:
        """How many data shards hold bytes of the key's block of ``version``."""
        block_len, payload_len = self.table.lengths(position, version)
        return min(self.k, -(-block_len // max(payload_len, 1)))

    def _whole(self, position: int) -> bool:
        """Whether every data shard of the key's complete version lies in its buffer, the
        buffer is the block's size, and its slot is not tainted."""
        version = self.complete[position]
        out = self.outs[position]
        if version is None or out is None:
            return False
        return (
            len(out) == self.table.lengths(position, version)[0]
            # cheap, first: too few data shards landed for it to be whole yet
            and self.num_in_place[position] >= self._data_shards(position, version)
            and all(self._placed(position, version))
            and not self._tainted(position, count=False)
        )

    async def settle_checks(self) -> None:
        """Wait until no block check still reads a buffer (they run in the pool)."""
        if self._checks:
            await finish_despite_cancel(asyncio.gather(*self._checks, return_exceptions=True))

    async def decode(self, pool: Executor | None) -> list[bytes | memoryview | None]:
        """Decode every complete key into its buffer (or new bytes); None for the rest.

        Blocks whose data shards all lie in their buffers (the usual case: every transport
        lands data shards at their place) are verified together, in one native call spread
        over threads without the GIL (erasure.fastsum.verify_blocks): the one pass over their
        bytes. The rest, and any that fail, decode key by key (parity rebuilds, rechecks),
        in the pool for batches of DECODE_POOL_MIN_BYTES and more.
        """
        todo = [(p, v) for p, v in enumerate(self.complete) if v is not None]
        checked_early = {p for p, ok in self.verified.items() if ok}
        position_to_block: dict[int, bytes | memoryview | None] = {
            p: self.outs[p] for p in checked_early
        }
        unchecked = [(p, v) for p, v in todo if p not in self.verified]
        position_to_block.update(await self._verify_assembled(self._assembled(unchecked), pool))
        rest = [(p, v) for p, v in todo if p not in position_to_block]
        self.table.collectors_for([p for p, _ in rest])  # their shards, in one pass
        num_bytes = sum(self.table.lengths(p, v)[0] for p, v in rest)
        if pool is not None and len(rest) > 1 and num_bytes >= DECODE_POOL_MIN_BYTES:
            calls = [functools.partial(self._decode_one, p, v) for p, v in rest]
            decoded = await run_in_pool(pool, calls)
        else:
            decoded = [self._decode_one(p, v) for p, v in rest]
        position_to_block.update(zip((p for p, _ in rest), decoded, strict=True))
        blocks: list[bytes | memoryview | None] = []
        counters = self.read.counters
        timed_out = self.timed_out()
        for position in range(len(self.complete)):
            block = position_to_block.get(position)
            blocks.append(block)
            if block is not None:
                counters.num_hits += 1
            elif timed_out[position]:
                counters.num_timeouts += 1
            else:
                counters.num_misses += 1
        counters.num_corrupt_shards += self.table.num_corrupt()
        return blocks

    def _assembled(self, todo: list[tuple[int, bytes]]) -> list[tuple[int, bytes, memoryview]]:
        """The complete keys whose block is whole in its buffer: every data shard it needs
        is of the key's version and lies at its place, or was copied there now (a padded last
        shard received apart). Anything else (a missing data shard, a plain get, a buffer of
        the wrong size or a tainted slot) is left to :meth:`_decode_one`."""
        assembled = []
        for position, version in todo:
            out = self.outs[position]
            block_len, payload_len = self.table.lengths(position, version)
            if out is None or len(out) != block_len or self._tainted(position, count=False):
                continue
            payload_len = max(payload_len, 1)
            needed = range(min(self.k, -(-block_len // payload_len)))
            held = self.table.indexes(position, version)
            if any(i not in held for i in needed):
                continue
            if all(self._placed(position, version)):
                assembled.append((position, version, out))
                continue
            shards = self.table.collectors_for([position])[position].version_to_shards[version]
            for i in needed:
                payload = shard_payload(shards[i])
                if not is_in(payload, out):
                    start = i * payload_len
                    piece = payload[: min(payload_len, block_len - start)]
                    out[start : start + len(piece)] = piece
                    self.rewritten.add(position)
            assembled.append((position, version, out))
        return assembled

    async def _verify_assembled(
        self, assembled: list[tuple[int, bytes, memoryview]], pool: Executor | None
    ) -> dict[int, bytes | memoryview | None]:
        """Position -> its block, for the assembled blocks whose checksum is their version
        (one native call); those that fail go to :meth:`_decode_one`."""
        if not assembled:
            return {}
        keys = [self.keys[position] for position, _, _ in assembled]
        outs = [out for _, _, out in assembled]
        versions = [version for _, version, _ in assembled]
        check = functools.partial(self.read.block_check.verify, keys, outs, versions)
        if pool is not None and sum(len(out) for out in outs) >= DECODE_POOL_MIN_BYTES:
            (verdicts,) = await run_in_pool(pool, [check])
        else:
            verdicts = check()
        return {
            position: out for (position, _, out), ok in zip(assembled, verdicts, strict=True) if ok
        }

    def _decode_one(self, position: int, version: bytes) -> bytes | memoryview | None:
        collector = self.table.collectors_for([position])[position]
        out = self.outs[position]
        block_len = collector.version_to_header[version].block_len
        if out is not None and len(out) != block_len:
            raise InvalidArgument(
                f"buffer {position} of the batch is {len(out)} bytes but block "
                f"{self.keys[position].hex()} is {block_len} bytes; pass a writable buffer of "
                "exactly the block's size"
            )
        if self._tainted(position):
            return None
        codec, counters = self.read.codec, self.read.counters
        if any(not in_place for in_place in self._placed(position, version)):
            self.rewritten.add(position)
        digest = self.read.block_check.digest_for(self.keys[position])
        try:
            # One pass: the block checksum covers every byte (shard checksums unchecked).
            return codec.decode(collector.shards(version), out=out, verified=True, digest=digest)
        except CodecError as exc:
            failure: CodecError = exc
        # The block failed: find the bad shards by their own checksums, decode without them.
        counters.num_rechecks += 1
        self.rewritten.add(position)
        if collector.recheck(version) and len(collector.version_to_shards[version]) >= self.k:
            try:
                shards = collector.shards(version)
                return codec.decode(shards, out=out, verified=True, digest=digest)
            except CodecError as exc:
                failure = exc
        log.warning("dropping version %s: %s", version.hex(), failure)
        counters.num_decode_failures += 1
        self.corrupt_misses.add(position)
        return None

    def _placed(self, position: int, version: bytes) -> list[bool]:
        """Per data shard the block needs, whether a shard of ``version`` landed in place."""
        out = self.outs[position]
        num_data_shards = self._data_shards(position, version)
        placed = self.table.placed(position, version, num_data_shards)
        if placed is not None:
            return [out is not None and p for p in placed]
        shards = self.table.collectors[position].version_to_shards[version]
        return [
            out is not None and i in shards and is_in(shards[i], out)
            for i in range(num_data_shards)
        ]

    def _tainted(self, position: int, *, count: bool = True) -> bool:
        """Whether the buffer at ``position`` is a pool slot a late node may still write
        (counted once)."""
        pool, offsets = self.read.landing_pool, self.pool_offsets
        offset = offsets[position] if offsets is not None else None
        if pool is None or offset is None or not pool.is_tainted(offset):
            return False
        self.read.counters.num_tainted += count
        return True


def _timed(timeline: ReadTimeline, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, its span added to the client lane of ``timeline`` (any thread)."""
    started_ns = time.monotonic_ns()
    try:
        return call()
    finally:
        timeline.add(CLIENT, what, started_ns)


def is_in(payload: memoryview | SplitShard | bytes, out: memoryview) -> bool:
    """Whether a payload (or a collected shard's) lies in ``out``'s memory (it landed at its
    place): a judgement the block checksum confirms, never trusted alone."""
    if isinstance(payload, SplitShard):
        payload = payload.payload
    return isinstance(payload, memoryview) and payload.obj is out.obj


async def run_in_pool(pool: Executor, calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in ``pool`` concurrently; their results in order (the first exception
    raised). One event-loop wake-up for the lot, and a cancel waits until every call
    finished: they may be writing into the caller's buffers."""
    loop = asyncio.get_running_loop()
    all_done: asyncio.Future[None] = loop.create_future()
    results: list[Any] = [None] * len(calls)
    remaining = [len(calls)]
    lock = threading.Lock()

    def finished(index: int, future: Future[Any]) -> None:
        results[index] = future
        with lock:
            remaining[0] -= 1
            last = not remaining[0]
        if last:
            loop.call_soon_threadsafe(_set_done, all_done)

    for index, call in enumerate(calls):
        pool.submit(call).add_done_callback(functools.partial(finished, index))
    await finish_despite_cancel(all_done)
    return [future.result() for future in results]


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
