"""The engine's store connector: plan, fetch-and-compute, swap-in buffers, write-back.

Per prefill::

    keys = block_keys(prompt, block_tokens, namespace, salt=tenant)   full blocks only
    plan = cost_model.plan(num_usable)     blocks [0, c) computed from the front while blocks
                                           [c, num_usable) are fetched (c = 0 when the store
                                           is faster than compute; Cake); a deadline
    land_batch(chunk of keys, pool slots)  a few chunks in flight (one request per node per
        on_landed -> Readiness             chunk): each node puts its data shards straight into
        -> SwapIn.blocks_arrived([i..])    the slots (the landing pool, client/landing_pool.py),
                                           and as soon as a block's data shards are all there
                                           its H2D copy starts on the side stream (CUDA), before
                                           the chunk's blocks are verified
    at the deadline: keep the leading run of verified blocks (re-copying any whose bytes
    changed after they were reported), compute the rest

There is no separate lookup: the fetch is the lookup (a block the store lacks is an index miss
on its nodes, a few microseconds each), so a cached prefill pays one round trip, not two.

Nothing on this path raises: a store that is down, a miss, a slow node or a deadline all become
"fewer cached blocks", and the engine computes them. The store verifies checksums, and the
namespace (model fingerprint, KV layout, dtype, block size) keeps other models' blocks out, so
a fetched block is this model's KV of these tokens. The number of blocks used is rounded down
to whole prefill chunks (see ``EngineConfig``).

After prefill the new full blocks are copied to host write slots (after the first token,
off the request's critical path) and stored in the background with one ``put_batch`` (the
request's traffic class); ``drain()`` waits for those writes. Blocks that find no free write
slot are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from client import KVClient, block_keys
from client.block_reads import Landing
from client.readiness import Readiness
from engine_adapter.config import EngineConfig
from engine_adapter.cost_model import FetchCostModel, FetchPlan
from engine_adapter.host_buffers import HostBlockPool, HostSlot
from engine_adapter.kv_format import num_valid_blocks, save_block
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.swap_in import SwapIn
from kvstore.config import ClusterConfig
from kvstore.errors import ERRORS, InvalidArgument, QuorumError

log = logging.getLogger(__name__)

StoreFailure = (*ERRORS, OSError)  # what a store call may raise that we absorb


@dataclass
class ConnectorStats:
    """Counters since the connector opened (benchmarks and tests read them)."""

    num_lookups: int = 0  # fetches (each is also the lookup)
    num_lookup_errors: int = 0  # fetches that failed outright
    num_matched_blocks: int = 0  # leading blocks fetches found
    num_fetched_blocks: int = 0  # blocks swapped in and used
    num_skipped_by_cost: int = 0  # usable blocks the cost model chose to compute instead
    num_fetch_fallbacks: int = 0  # fetches that delivered fewer blocks than planned
    num_deadlines_exceeded: int = 0
    num_written_blocks: int = 0
    num_write_errors: int = 0
    num_write_skipped: int = 0  # no free write slot
    # blocks refused after they arrived: the wrong size for the key, or (e4m3x16) a NaN scale
    num_bad_blocks: int = 0


@dataclass
class FetchOutcome:
    """What the store contributed to one prefill."""

    swap_in: SwapIn
    num_matched_blocks: int  # leading blocks the fetch found, from first_block on
    num_fetched_blocks: int  # leading blocks swapped in and used, from first_block on
    lookup_s: float  # 0: the fetch is the lookup (kept for the benchmarks' columns)
    fetch_s: float
    # Why fewer blocks than usable were used: "cost" (the plan computes some, or all),
    # "deadline", "miss" (the store lacked one), "error", "bad_block" (the wrong size for
    # its key, or a NaN scale: never placed in the cache) or "no_buffer"; None otherwise.
    fallback: str | None
    slots: list[HostSlot] = field(default_factory=list)
    # land_batch time of the chunk each arrived block came in, not counting the wait for
    # a fetch_concurrency turn (benchmarks read its tail)
    block_fetch_s: list[float] = field(default_factory=list)
    first_block: int = 0  # blocks before it were computed while the rest was fetched

    @property
    def first_uncached_block(self) -> int:
        """Where write-back starts: after the blocks the fetch found, or at 0 when it found
        none (the blocks computed meanwhile were never asked for)."""
        if not self.num_matched_blocks:
            return 0
        return self.first_block + self.num_matched_blocks


class StoreConnector:
    """Connects one engine (one model, one KV layout) to a kvstore cluster."""

    def __init__(
        self,
        cluster: str | Path | ClusterConfig,
        cache: PagedKVCache,
        namespace: str,
        config: EngineConfig,
        max_blocks: int,
        token: str | None = None,
    ) -> None:
        self.cluster, self.token = cluster, token
        self.cache, self.layout, self.namespace = cache, cache.layout, namespace
        self.config = config
        self.cost_model = FetchCostModel(
            min_deadline_s=config.fetch_min_deadline_s, max_deadline_s=config.fetch_deadline_s
        )
        self.stats = ConnectorStats()
        pin = cache.kv.device.type == "cuda"
        # Fetched blocks land here, written by the store's local nodes themselves.
        self.fetch_buffers = HostBlockPool(self.layout, max_blocks, pin_memory=pin, shared=True)
        self.write_buffers = HostBlockPool(self.layout, max_blocks, pin_memory=pin)
        self._clients: dict[str, KVClient] = {}
        self._connecting: dict[str, asyncio.Task[KVClient]] = {}
        self._write_gate = asyncio.Semaphore(config.write_concurrency)
        self._pending_writes: set[asyncio.Task[None]] = set()

    def keys(self, token_ids: Sequence[int], tenant: str) -> list[bytes]:
        """Store keys of the full blocks of ``token_ids``; the tenant is the salt."""
        return block_keys(list(token_ids), self.layout.block_tokens, self.namespace, tenant)

    async def client(self, tenant: str, timeout_s: float | None = None) -> KVClient:
        """This tenant's client (the store checks the tenant on every shard). A connect
        that outlasts ``timeout_s`` raises TimeoutError and goes on in the background, so a
        fetch's deadline covers connecting too and the next fetch finds the client."""
        if tenant in self._clients:
            return self._clients[tenant]
        task = self._connecting.get(tenant)
        if task is None:
            task = self._connecting[tenant] = asyncio.create_task(self._connect(tenant))
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)

    async def _connect(self, tenant: str) -> KVClient:
        try:
            kv = await KVClient.connect(
                self.cluster,
                tenant=tenant,
                token=self.token,
                transport=self.config.store_transport,
                landing_pool=self.fetch_buffers.landing_pool,
            )
        finally:
            self._connecting.pop(tenant, None)  # a failed connect is tried again next time
        self._clients[tenant] = kv
        return kv

    def plan(self, num_usable: int) -> FetchPlan:
        """Which usable blocks to fetch and which to compute meanwhile (cost_model.py)."""
        always = self.config.fetch_policy == "always"
        return self.cost_model.plan(
            num_usable,
            self.layout.block_tokens,
            self.layout.block_bytes,
            always,
            self.config.blocks_per_chunk,
        )

    async def fetch_prefix(
        self, keys: list[bytes], table: BlockTable, num_usable: int, tenant: str
    ) -> FetchOutcome:
        """Swap in as many of the first ``num_usable`` blocks as are cached and worth it
        (the plan's blocks: :meth:`plan` then :meth:`fetch`)."""
        return await self.fetch(keys, table, self.plan(num_usable), tenant)

    async def fetch(
        self, keys: list[bytes], table: BlockTable, plan: FetchPlan, tenant: str
    ) -> FetchOutcome:
        """Fetch the plan's blocks (from ``plan.first_block`` on) into host slots, start their
        swap-in, and say how many leading ones arrived."""
        started = time.perf_counter()
        first = plan.first_block
        self.stats.num_lookups += 1
        slots = self._acquire_whole_chunks(self._whole_chunks(plan.num_blocks))
        host_blocks = [slot.block for slot in slots]
        swap_in = SwapIn(self.cache, table.block_ids[first:], host_blocks)
        num_arrived, num_landed, reason, block_fetch_s = await self._fetch(
            keys[first:], slots, swap_in, tenant, plan.deadline_s
        )
        num_valid = self._num_valid(host_blocks[:num_arrived])
        if num_valid < num_arrived:
            num_arrived, reason = num_valid, "bad_block"
        fetch_s = time.perf_counter() - started
        if reason is None and len(slots) < plan.num_blocks:
            reason = "no_buffer"
        num_used = self._whole_chunks(num_arrived)
        swap_in.start(num_used)
        self._record(num_arrived, first, num_used, num_landed, reason, fetch_s, first > 0)
        if reason is None and first:
            reason = "cost"
        return FetchOutcome(
            swap_in, num_arrived, num_used, 0.0, fetch_s, reason, slots, block_fetch_s, first
        )

    def release(self, outcome: FetchOutcome) -> None:
        """The prefill that used ``outcome`` is done with its host slots (compute synced)."""
        for slot in outcome.slots:
            slot.release()
        outcome.slots.clear()

    async def write_back(
        self,
        keys: list[bytes],
        table: BlockTable,
        first_block: int,
        tenant: str,
        traffic_class: str,
    ) -> None:
        """Copy blocks ``first_block`` onwards to write slots now; put them in the background."""
        indexes = list(range(first_block, len(keys)))
        slots = self.write_buffers.acquire(len(indexes))
        self.stats.num_write_skipped += len(indexes) - len(slots)
        if not slots:
            return
        await asyncio.to_thread(self._snapshot, table, indexes[: len(slots)], slots)
        batch = [keys[index] for index in indexes[: len(slots)]]
        # One put_batch per fetch chunk: a long prompt's blocks (a 64k prompt writes 1,000
        # of 2 MiB) would otherwise be one request per node of gigabytes, past any deadline.
        chunk = self.config.fetch_chunk_blocks
        for start in range(0, len(batch), chunk):
            task = asyncio.create_task(
                self._put(
                    batch[start : start + chunk],
                    slots[start : start + chunk],
                    tenant,
                    traffic_class,
                )
            )
            self._pending_writes.add(task)
            task.add_done_callback(self._pending_writes.discard)

    async def drain(self) -> None:
        """Wait until every background write-back has finished."""
        while self._pending_writes:
            await asyncio.gather(*list(self._pending_writes), return_exceptions=True)

    def transport_used(self) -> str:
        """What answered most of the fetches' node requests: local, ucx or grpc."""
        counts: dict[str, int] = {}
        for kv in self._clients.values():
            for name, count in kv.replies_by_transport().items():
                counts[name] = counts.get(name, 0) + count
        return max(counts, key=lambda name: counts[name]) if counts else ""

    async def close(self) -> None:
        """Finish write-backs, then close every tenant's client and the fetch pool."""
        await self.drain()
        await asyncio.gather(*self._connecting.values(), return_exceptions=True)
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(kv.close() for kv in clients), return_exceptions=True)
        self.fetch_buffers.close()

    def _num_valid(self, blocks: list[torch.Tensor]) -> int:
        """Leading arrived blocks that may enter the cache (e4m3x16: no NaN scale)."""
        if not self.layout.quantized or not blocks:
            return len(blocks)
        num_valid = num_valid_blocks(blocks, self.layout.part_shape)
        self.stats.num_bad_blocks += num_valid < len(blocks)
        return num_valid

    def _whole_chunks(self, num_blocks: int) -> int:
        per_chunk = self.config.blocks_per_chunk
        return num_blocks // per_chunk * per_chunk

    def _acquire_whole_chunks(self, num_blocks: int) -> list[HostSlot]:
        slots = self.fetch_buffers.acquire(num_blocks)
        for slot in slots[self._whole_chunks(len(slots)) :]:
            slot.release()
        return slots[: self._whole_chunks(len(slots))]

    async def _connected(self, tenant: str, deadline_s: float) -> KVClient | str:
        """The tenant's store client, or why there is none in time ("deadline", "error")."""
        try:
            return await self.client(tenant, timeout_s=deadline_s)
        except TimeoutError:  # still connecting: this prompt computes, the next one fetches
            return "deadline"
        except StoreFailure as exc:  # a store we cannot reach is a miss, not an error
            self.stats.num_lookup_errors += 1
            log.warning("store unreachable, computing the whole prompt: %s", exc)
            return "error"

    async def _fetch(
        self,
        keys: list[bytes],
        slots: list[HostSlot],
        swap_in: SwapIn,
        tenant: str,
        deadline_s: float,
    ) -> tuple[int, int, str | None, list[float]]:
        """land_batch the slots, chunk by chunk, by the deadline: (leading blocks arrived,
        blocks arrived in all, why not all, each arrived block's chunk's seconds)."""
        if not slots:
            return 0, 0, None, []
        deadline = time.perf_counter() + deadline_s
        kv = await self._connected(tenant, deadline_s)
        if isinstance(kv, str):
            return 0, 0, kv, []
        chunks = _FetchChunks(kv, keys, slots, swap_in, self.layout.block_bytes, deadline)
        num_arrived, reason = await chunks.run(self.config.fetch_chunk_blocks, self._fetch_gate())
        if reason == "bad_block":
            self.stats.num_bad_blocks += 1
        elif reason == "error":
            self.stats.num_lookup_errors += 1
        return num_arrived, len(chunks.block_fetch_s), reason, chunks.block_fetch_s

    def _fetch_gate(self) -> asyncio.Semaphore:
        """Admits one fetch's chunks: ``fetch_concurrency`` blocks in flight, a chunk at least."""
        chunk = self.config.fetch_chunk_blocks
        return asyncio.Semaphore(max(1, self.config.fetch_concurrency // chunk))

    def _record(
        self,
        num_found: int,
        num_computed: int,
        num_used: int,
        num_landed: int,
        reason: str | None,
        fetch_s: float,
        overlapped: bool,
    ) -> None:
        stats = self.stats
        stats.num_matched_blocks += num_found
        stats.num_fetched_blocks += num_used
        stats.num_skipped_by_cost += num_computed
        stats.num_fetch_fallbacks += reason is not None
        stats.num_deadlines_exceeded += reason == "deadline"
        if overlapped and reason is None:
            # The front's compute shared the host with this fetch, so its time says less
            # about the store than about the overlap; learning from it fed back into ever
            # larger fronts (H200 run 5: docs/runs/swapin-h200).
            return
        if reason in (None, "miss") and num_landed:  # every block the fetch moved counts
            self.cost_model.observe_fetch(num_landed * self.layout.block_bytes, fetch_s)
        elif reason == "miss":  # nothing moved: the fetch's time is its fixed cost
            self.cost_model.observe_latency(fetch_s)
        elif reason == "deadline":  # the store was slow: expect slow fetches from now on
            self.cost_model.observe_fetch(max(num_used, 1) * self.layout.block_bytes, fetch_s)

    def _snapshot(self, table: BlockTable, indexes: list[int], slots: list[HostSlot]) -> None:
        """Serialise the table's blocks ``indexes`` into ``slots`` (runs in a worker thread)."""
        device = self.cache.kv.device
        stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            for index, slot in zip(indexes, slots, strict=True):
                save_block(self.cache, table.block_ids[index], slot.block)
        if stream is not None:
            stream.synchronize()

    async def _put(
        self, keys: list[bytes], slots: list[HostSlot], tenant: str, traffic_class: str
    ) -> None:
        """One put_batch of written-back blocks (best effort: a block not stored is just not
        cached)."""
        try:
            async with self._write_gate:
                kv = await self.client(tenant)
                views = [slot.view for slot in slots]
                await kv.put_batch(keys, views, traffic_class=traffic_class)
            self.stats.num_written_blocks += len(keys)
        except QuorumError as exc:
            failed = len(getattr(exc, "keys", keys))
            self.stats.num_written_blocks += len(keys) - failed
            self.stats.num_write_errors += failed
            log.warning("write-back of %d KV blocks failed: %s", failed, exc)
        except StoreFailure as exc:
            self.stats.num_write_errors += len(keys)
            log.warning("write-back of %d KV blocks failed: %s", len(keys), exc)
        finally:
            for slot in slots:
                slot.release()


class _FetchChunks:
    """One fetch's land_batch calls, a chunk of blocks each, at most ``concurrency`` blocks in
    flight. A block's swap-in starts once its data shards are in (Readiness), again if they
    changed.

    Only the leading run of arrived blocks is used, so the first miss ends the fetch past it:
    chunks after it that have not started are skipped and those in flight cancelled (a
    10%-cached prompt asks for the 10% and a chunk of misses, not for every block).

    The first chunk goes out alone, the others once a data shard of its last block landed
    (the cached prefix goes on past it) or it ended: a prompt the store lacks, or holds
    only the start of, costs one chunk's requests, not every chunk's. On one H100 a fetch of
    256 missing blocks cost 23-36 ms in 48 requests, 64 of them 4-5 ms in 12: slower than
    recomputing at 0% and 10% cached. What the wait costs a fetch that hits: its later
    chunks start one node answer later, while the nodes still serve the first.
    """

    def __init__(
        self,
        kv: KVClient,
        keys: list[bytes],
        slots: list[HostSlot],
        swap_in: SwapIn,
        block_bytes: int,
        deadline: float,
    ) -> None:
        self.kv, self.keys, self.slots, self.swap_in = kv, keys, slots, swap_in
        self.deadline = deadline  # time.perf_counter()
        self.readiness = Readiness(
            len(slots), block_bytes, kv.codec.k, on_blocks=swap_in.blocks_arrived
        )
        self.block_fetch_s: list[float] = []  # each arrived block's chunk's seconds
        self.first_miss = len(slots)  # the lowest block index known missing
        self.tasks: dict[int, asyncio.Task[Landing]] = {}  # chunk start -> its task
        self._first_chunk_end = 0  # its last block landing a shard releases the others
        self._prefix_goes_on = asyncio.Event()

    async def run(self, chunk: int, gate: asyncio.Semaphore) -> tuple[int, str | None]:
        """(leading blocks arrived, why the first that did not failed, or None); ``gate``
        admits the chunks in flight."""
        starts = list(range(0, len(self.slots), chunk))
        if not starts:
            return 0, None
        self._first_chunk_end = min(chunk, len(self.slots))
        first = self.tasks[0] = asyncio.create_task(self._chunk(0, self._first_chunk_end, gate))
        if len(starts) > 1:
            goes_on = asyncio.ensure_future(self._prefix_goes_on.wait())
            try:
                await asyncio.wait(
                    (first, goes_on),
                    timeout=max(self.deadline - time.perf_counter(), 0.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                goes_on.cancel()
        for start in starts[1:]:  # past a miss already known they return at once
            end = min(start + chunk, len(self.slots))
            self.tasks[start] = asyncio.create_task(self._chunk(start, end, gate))
        timeout_s = max(self.deadline - time.perf_counter(), 0.0)
        _, pending = await asyncio.wait(self.tasks.values(), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return _leading_run(list(self.tasks.values()), list(self.tasks))

    async def _chunk(self, start: int, end: int, gate: asyncio.Semaphore) -> Landing:
        async with gate:
            started = time.perf_counter()
            remaining_s = self.deadline - started
            if remaining_s <= 0 or start > self.first_miss:
                return Landing.nothing(end - start, timed_out=remaining_s <= 0)
            landing = await self.kv.land_batch(
                self.keys[start:end],
                [slot.view for slot in self.slots[start:end]],
                on_landed=functools.partial(self._landed, start),
                timeout_s=remaining_s,
            )
            elapsed_s = time.perf_counter() - started
        copy_again: list[int] = []
        for index, (ok, again) in enumerate(
            zip(landing.landed, landing.rewritten, strict=True), start
        ):
            if ok:
                self.block_fetch_s.append(elapsed_s)
                if again or not self.readiness.block_complete(index):
                    copy_again.append(index)
        self.swap_in.blocks_arrived(copy_again)
        if not all(landing.landed):
            self._missed(start + landing.landed.index(False))
        return landing

    def _landed(self, start: int, pairs: list[tuple[int, int]]) -> None:
        """Data shards (block, shard index) of the chunk at block ``start`` are in place:
        to Readiness, and a shard of the first chunk's last block lets the other chunks go."""
        self.readiness.landed(pairs, base=start)
        if not self._prefix_goes_on.is_set() and self.readiness.any_landed(
            self._first_chunk_end - 1
        ):
            self._prefix_goes_on.set()

    def _missed(self, index: int) -> None:
        self.first_miss = min(self.first_miss, index)
        for start, task in self.tasks.items():
            if start > self.first_miss:
                task.cancel()


def _leading_run(tasks: list[asyncio.Task[Landing]], starts: list[int]) -> tuple[int, str | None]:
    """How many leading blocks arrived, and why the first that did not failed (or None)."""
    for task, start in zip(tasks, starts, strict=True):
        if task.cancelled():
            return start, "deadline"
        error = task.exception()
        if isinstance(error, InvalidArgument):  # a stored block of the wrong size for its key
            log.warning("a cached KV block is malformed, computing instead: %s", error)
            return start, "bad_block"
        if error is not None:
            log.warning("fetching cached KV blocks failed, computing instead", exc_info=error)
            return start, "error"
        landing = task.result()
        if not all(landing.landed):
            first = landing.landed.index(False)
            # The land_batch's own timeout says it, not the clock after it returned: the two
            # read different clocks, so a read cut at the deadline could look like a miss.
            return start + first, "deadline" if landing.timed_out[first] else "miss"
    return sum(len(task.result().landed) for task in tasks), None
