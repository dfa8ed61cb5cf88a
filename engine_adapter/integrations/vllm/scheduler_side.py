"""The connector's scheduler side: lookups, load plans, save plans and stored-block reports."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_adapter.connector import StoreFailure
from engine_adapter.integrations.vllm.metadata import BlockTransfer, KVStoreConnectorMetadata

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from engine_adapter.integrations.vllm.connector import KVStoreConnector

log = logging.getLogger(__name__)

MAX_PENDING_REPORTS = 100_000  # stored-block reports waiting for the other slices' writers


@dataclass(frozen=True)
class _Lookup:
    first: int  # the first block the store may provide
    num_hits: int  # leading blocks every slice of which is stored
    num_asked: int


@dataclass
class _Tracked:
    """A running request the scheduler side saves blocks of."""

    request: Request
    block_ids: list[int]
    num_saved_blocks: int


class SchedulerSide:
    """Lookup, load plans and save plans (runs in vLLM's scheduler)."""

    def __init__(self, connector: KVStoreConnector) -> None:
        self.c = connector
        self._requests: dict[str, Request] = {}  # every request seen, until it finishes
        self._lookups: dict[str, _Lookup] = {}  # req_id -> its latest lookup
        self._pending_loads: list[BlockTransfer] = []
        self._tracked: dict[str, _Tracked] = {}
        # BlockStored -> how many slice writers reported it; out once every slice did.
        self._stored_reports: Counter[KVCacheEvent] = Counter()
        self._stored: list[KVCacheEvent] = []

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        c, block_size = self.c, self.c.block_size
        self._requests[request.request_id] = request
        first = num_computed_tokens // block_size
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // block_size)
        if not c.is_consumer or usable <= first:
            return 0
        hashes = [bytes(h) for h in request.block_hashes[first:usable]]
        salt = c.salt_of(request)
        keys = [key for ns in c.namespaces for key in ns.keys(hashes, salt)]
        num_hashes = len(hashes)
        try:
            present = c.kv.contains(keys)
        except StoreFailure as exc:  # a lookup that fails is a miss
            log.warning("kvstore lookup failed, computing request %s: %s", request.request_id, exc)
            present = [False] * len(keys)
        # contains() answers slice after slice; a block counts when every slice is there.
        num_hits = 0
        while num_hits < num_hashes and all(present[num_hits::num_hashes]):
            num_hits += 1
        self._lookups[request.request_id] = _Lookup(first, num_hits, num_hashes)
        return num_hits * block_size

    def plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called once the request's blocks are allocated: count its lookup, plan its load."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        num_misses = lookup.num_asked - lookup.num_hits
        self.c.stats.add(num_lookups=1, hit_blocks=lookup.num_hits, miss_blocks=num_misses)
        if num_external_tokens <= 0:
            return
        first, num_blocks = lookup.first, num_external_tokens // self.c.block_size
        block_ids = blocks.get_block_ids()[0][first : first + num_blocks]
        hashes = [bytes(h) for h in request.block_hashes[first : first + num_blocks]]
        salt = self.c.salt_of(request)
        self._pending_loads.append(BlockTransfer(request.request_id, hashes, salt, block_ids))

    def build_meta(self, out: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        for new in out.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            num_saved = new.num_computed_tokens // self.c.block_size  # local and loaded hits
            tracked = _Tracked(request, list(new.block_ids[0]), num_saved)
            self._tracked[new.req_id] = tracked
            num_done = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            self._plan_save(meta, tracked, num_done)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_block_ids is not None:
                tracked.block_ids = list(new_block_ids[0])  # preempted: all blocks are new
            elif new_block_ids is not None:
                tracked.block_ids.extend(new_block_ids[0])
            num_done = cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id]
            self._plan_save(meta, tracked, num_done)
        return meta

    def _plan_save(
        self, meta: KVStoreConnectorMetadata, tracked: _Tracked, num_done_tokens: int
    ) -> None:
        """Save the blocks that are full once this step has computed ``num_done_tokens``."""
        if not self.c.is_producer:
            return
        request, block_size = tracked.request, self.c.block_size
        end = min(num_done_tokens // block_size, len(request.block_hashes), len(tracked.block_ids))
        if not self.c.save_decode:
            end = min(end, request.num_prompt_tokens // block_size)
        start = tracked.num_saved_blocks
        if end <= start:
            return
        hashes = [bytes(h) for h in request.block_hashes[start:end]]
        salt = self.c.salt_of(request)
        block_ids = tracked.block_ids[start:end]
        parent = bytes(request.block_hashes[start - 1]) if start else None
        tokens = list(request.all_token_ids[start * block_size : end * block_size])
        transfer = BlockTransfer(request.request_id, hashes, salt, block_ids, parent, tokens)
        meta.saves.append(transfer)
        tracked.num_saved_blocks = end

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._tracked.pop(req_id, None)
        self._lookups.pop(req_id, None)

    def collect_stored(self, events: list[KVCacheEvent]) -> None:
        """Count the workers' reports; a block is stored once every slice writer reported."""
        self._stored_reports.update(events)
        num_slices = len(self.c.namespaces)
        done = [event for event, count in self._stored_reports.items() if count >= num_slices]
        for event in done:
            del self._stored_reports[event]
        self._stored += done
        if len(self._stored_reports) > MAX_PENDING_REPORTS:  # a writer's puts keep failing
            self._stored_reports.clear()

    def take_stored(self) -> list[KVCacheEvent]:
        stored, self._stored = self._stored, []
        return stored
