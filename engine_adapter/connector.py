"""The engine's store connector: lookup, fetch-or-compute, swap-in buffers, write-back.

Per prefill::

    keys = block_keys(prompt, block_tokens, namespace, salt=tenant)   full blocks only
    num_matched = match_prefix(keys[:num_usable])   num_usable leaves >= 1 token to compute
    plan = cost_model.plan(num_matched)             fetch all or none, and a deadline
    get_batch_into(chunk of keys, host slots)       a few chunks in flight (one request per
        -> SwapIn.block_arrived(i) per block         node per chunk); each block lands in a
                                                    reusable slot and, on CUDA, its H2D copy
                                                    starts as soon as its chunk landed
    at the deadline: keep the leading run of blocks that arrived, compute the rest

Nothing on this path raises: a store that is down, a miss between lookup and fetch, a slow
node or a deadline all become "fewer cached blocks", and the engine computes them. The store
verifies checksums, and the namespace (model fingerprint, KV layout, dtype, block size)
keeps other models' blocks out, so a fetched block is this model's KV of these tokens.
The number of blocks used is rounded down to whole prefill chunks (see ``EngineConfig``).

After prefill the new full blocks are copied to host write slots (after the first token,
off the request's critical path) and stored in the background with one ``put_batch`` (the
request's traffic class); ``drain()`` waits for those writes. Blocks that find no free write
slot are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from client import KVClient, block_keys
from engine_adapter.config import EngineConfig
from engine_adapter.cost_model import FetchCostModel
from engine_adapter.host_buffers import HostBlockPool, HostSlot
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.swap_in import SwapIn
from kvstore.config import ClusterConfig
from kvstore.errors import ERRORS, QuorumError

log = logging.getLogger(__name__)

StoreFailure = (*ERRORS, OSError)  # what a store call may raise that we absorb


@dataclass
class ConnectorStats:
    """Counters since the connector opened (benchmarks and tests read them)."""

    num_lookups: int = 0
    num_lookup_errors: int = 0
    num_matched_blocks: int = 0
    num_fetched_blocks: int = 0  # blocks swapped in and used
    num_skipped_by_cost: int = 0  # matched blocks the cost model chose to recompute
    num_fetch_fallbacks: int = 0  # fetches that delivered fewer blocks than planned
    num_deadlines_exceeded: int = 0
    num_written_blocks: int = 0
    num_write_errors: int = 0
    num_write_skipped: int = 0  # no free write slot


@dataclass
class FetchOutcome:
    """What the store contributed to one prefill."""

    swap_in: SwapIn
    num_matched_blocks: int  # leading blocks the store had (before the cost model)
    num_fetched_blocks: int  # leading blocks swapped in and used
    lookup_s: float
    fetch_s: float
    # Why fewer blocks than matched were used: "cost" (recomputing is faster), "deadline",
    # "miss" (gone since the lookup), "error" or "no_buffer"; None otherwise.
    fallback: str | None
    slots: list[HostSlot] = field(default_factory=list)
    # get_batch_into time of the chunk each arrived block came in, not counting the wait for
    # a fetch_concurrency turn (benchmarks read its tail)
    block_fetch_s: list[float] = field(default_factory=list)


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
        self.fetch_buffers = HostBlockPool(self.layout, max_blocks, pin_memory=pin)
        self.write_buffers = HostBlockPool(self.layout, max_blocks, pin_memory=pin)
        self._clients: dict[str, KVClient] = {}
        self._connect_lock = asyncio.Lock()
        self._write_gate = asyncio.Semaphore(config.write_concurrency)
        self._pending_writes: set[asyncio.Task[None]] = set()

    def keys(self, token_ids: Sequence[int], tenant: str) -> list[bytes]:
        """Store keys of the full blocks of ``token_ids``; the tenant is the salt."""
        return block_keys(list(token_ids), self.layout.block_tokens, self.namespace, tenant)

    async def client(self, tenant: str) -> KVClient:
        """This tenant's client (the store checks the tenant on every shard)."""
        async with self._connect_lock:
            if tenant not in self._clients:
                self._clients[tenant] = await KVClient.connect(
                    self.cluster,
                    tenant=tenant,
                    token=self.token,
                    transport=self.config.store_transport,
                )
            return self._clients[tenant]

    async def fetch_prefix(
        self, keys: list[bytes], table: BlockTable, num_usable: int, tenant: str
    ) -> FetchOutcome:
        """Swap in as many of the first ``num_usable`` blocks as are cached and worth it."""
        started = time.perf_counter()
        num_matched = await self._lookup(keys[:num_usable], tenant)
        lookup_s = time.perf_counter() - started
        always = self.config.fetch_policy == "always"
        plan = self.cost_model.plan(
            num_matched, self.layout.block_tokens, self.layout.block_bytes, always
        )
        num_wanted = self._whole_chunks(plan.num_blocks)
        slots = self._acquire_whole_chunks(num_wanted)
        host_blocks = [slot.block for slot in slots]
        swap_in = SwapIn(self.cache, table.block_ids, host_blocks)
        num_arrived, reason, block_fetch_s = await self._fetch(
            keys, slots, swap_in, tenant, plan.deadline_s
        )
        fetch_s = time.perf_counter() - started - lookup_s
        if reason is None and len(slots) < num_wanted:
            reason = "no_buffer"
        num_used = self._whole_chunks(num_arrived)
        swap_in.start(num_used)
        self._record(num_matched, plan.num_blocks, num_used, reason, fetch_s)
        if reason is None and plan.num_blocks < num_matched:
            reason = "cost"
        return FetchOutcome(
            swap_in, num_matched, num_used, lookup_s, fetch_s, reason, slots, block_fetch_s
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
        task = asyncio.create_task(self._put(batch, slots, tenant, traffic_class))
        self._pending_writes.add(task)
        task.add_done_callback(self._pending_writes.discard)

    async def drain(self) -> None:
        """Wait until every background write-back has finished."""
        while self._pending_writes:
            await asyncio.gather(*list(self._pending_writes), return_exceptions=True)

    async def close(self) -> None:
        """Finish write-backs, then close every tenant's client."""
        await self.drain()
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(kv.close() for kv in clients), return_exceptions=True)

    def _whole_chunks(self, num_blocks: int) -> int:
        per_chunk = self.config.blocks_per_chunk
        return num_blocks // per_chunk * per_chunk

    def _acquire_whole_chunks(self, num_blocks: int) -> list[HostSlot]:
        slots = self.fetch_buffers.acquire(num_blocks)
        for slot in slots[self._whole_chunks(len(slots)) :]:
            slot.release()
        return slots[: self._whole_chunks(len(slots))]

    async def _lookup(self, keys: list[bytes], tenant: str) -> int:
        self.stats.num_lookups += 1
        if not keys:
            return 0
        try:
            started = time.perf_counter()
            num_matched = await (await self.client(tenant)).match_prefix(keys)
            self.cost_model.observe_latency(time.perf_counter() - started)
            return num_matched
        except StoreFailure as exc:  # a failed lookup is a miss, not an error
            self.stats.num_lookup_errors += 1
            log.warning("store lookup failed, computing the whole prompt: %s", exc)
            return 0

    async def _fetch(
        self,
        keys: list[bytes],
        slots: list[HostSlot],
        swap_in: SwapIn,
        tenant: str,
        deadline_s: float,
    ) -> tuple[int, str | None, list[float]]:
        """get_batch_into the slots, chunk by chunk, by the deadline: (leading blocks that
        arrived, why not all, the get_batch_into seconds of each arrived block's chunk)."""
        if not slots:
            return 0, None, []
        kv = await self.client(tenant)
        deadline = time.perf_counter() + deadline_s
        chunk = self.config.fetch_chunk_blocks
        gate = asyncio.Semaphore(max(1, self.config.fetch_concurrency // chunk))
        block_fetch_s: list[float] = []

        async def fetch_chunk(start: int, end: int) -> list[bool]:
            async with gate:
                started = time.perf_counter()
                remaining_s = deadline - started
                if remaining_s <= 0:
                    return [False] * (end - start)
                views = [slot.view for slot in slots[start:end]]
                landed = await kv.get_batch_into(keys[start:end], views, timeout_s=remaining_s)
                elapsed_s = time.perf_counter() - started
            for index, ok in enumerate(landed, start):
                if ok:
                    block_fetch_s.append(elapsed_s)
                    swap_in.block_arrived(index)
            return landed

        spans = [(start, min(start + chunk, len(slots))) for start in range(0, len(slots), chunk)]
        tasks = [asyncio.create_task(fetch_chunk(start, end)) for start, end in spans]
        _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.perf_counter(), 0.0))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        deadline_passed = bool(pending) or time.perf_counter() >= deadline
        num_arrived, reason = _leading_run(tasks, [start for start, _ in spans], deadline_passed)
        return num_arrived, reason, block_fetch_s

    def _record(
        self, num_matched: int, num_planned: int, num_used: int, reason: str | None, fetch_s: float
    ) -> None:
        stats = self.stats
        stats.num_matched_blocks += num_matched
        stats.num_fetched_blocks += num_used
        stats.num_skipped_by_cost += num_matched - num_planned
        stats.num_fetch_fallbacks += reason is not None
        stats.num_deadlines_exceeded += reason == "deadline"
        if reason is None and num_used:
            self.cost_model.observe_fetch(num_used * self.layout.block_bytes, fetch_s)
        elif reason == "deadline":  # the store was slow: expect slow fetches from now on
            self.cost_model.observe_fetch(max(num_used, 1) * self.layout.block_bytes, fetch_s)

    def _snapshot(self, table: BlockTable, indexes: list[int], slots: list[HostSlot]) -> None:
        """Serialise the table's blocks ``indexes`` into ``slots`` (runs in a worker thread)."""
        device = self.cache.kv.device
        stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            for index, slot in zip(indexes, slots, strict=True):
                self.cache.save_block(table.block_ids[index], slot.block)
        if stream is not None:
            stream.synchronize()

    async def _put(
        self, keys: list[bytes], slots: list[HostSlot], tenant: str, traffic_class: str
    ) -> None:
        """One put_batch of the written-back blocks (best effort: a block not stored is just
        not cached)."""
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


def _leading_run(
    tasks: list[asyncio.Task[list[bool]]], starts: list[int], deadline_passed: bool
) -> tuple[int, str | None]:
    """How many leading blocks arrived, and why the first that did not failed (or None)."""
    for task, start in zip(tasks, starts, strict=True):
        if task.cancelled():
            return start, "deadline"
        error = task.exception()
        if error is not None:
            log.warning("fetching cached KV blocks failed, computing instead", exc_info=error)
            return start, "error"
        landed = task.result()
        if not all(landed):
            return start + landed.index(False), "deadline" if deadline_passed else "miss"
    return sum(len(task.result()) for task in tasks), None
