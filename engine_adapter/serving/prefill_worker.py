"""The prefill worker: cache-backed prefill, the first token, then the handoff.

Its engine's connector looks the prompt's blocks up in the store, swaps in those worth
fetching, computes the rest and writes the new blocks back; once they are in the store the
worker sends the handoff (``handoff.py``) that a decode worker continues from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from engine_adapter.engine import PrefillResult, Sampler
from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from engine_adapter.serving.handoff import handoff_layout, make_sampler, sampler_state, tail_kv
from engine_adapter.serving.request import chat_prompt_ids
from engine_adapter.serving.worker_base import WorkerBase, complete
from kvstore.errors import Unavailable


class PrefillWorker(WorkerBase, pb_grpc.PrefillWorkerServicer):
    """Cache-backed prefill, then the handoff (see the module doc)."""

    role = "prefill"

    async def Prefill(  # gRPC method name
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillEvent]:
        start_s = time.perf_counter()
        async with self.serving(context, request.request_id) as holds:
            if not holds:
                raise Unavailable(f"prefill worker {self.worker_id} is draining")
            busy_start_s = time.perf_counter()
            await self.tenant_access.check(self.engine, request.tenant)
            await self.check_traffic_class(request.traffic_class)
            prompt_ids = self.prompt_ids(request)
            self.check_length(len(prompt_ids), request.sampling)
            prefill = self.engine.prefill(
                prompt_ids,
                tenant=request.tenant,
                traffic_class=request.traffic_class,
                cache_salt=request.cache_salt,
            )
            result = await complete(prefill, lambda r: self.engine.release(r.sequence))
            self.turns.progress()
            try:
                async for event in self._handoff(request, result, start_s, busy_start_s):
                    yield event
            finally:
                self.engine.release(result.sequence)

    def prompt_ids(self, request: pb.PrefillRequest) -> list[int]:
        """The request's token ids, or its conversation through the chat template."""
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return chat_prompt_ids(self.engine.require_tokenizer(), messages)
        return self.engine.encode_prompt(list(request.token_ids))

    async def _handoff(
        self, request: pb.PrefillRequest, result: PrefillResult, start_s: float, busy_start_s: float
    ) -> AsyncIterator[pb.PrefillEvent]:
        """The first token at once; the handoff once the new blocks are in the store."""
        sampler = make_sampler(request.sampling)
        first_token_id = sampler.sample(result.logits)
        stats = self._stats(result, start_s, busy_start_s)
        text = self.text([first_token_id])
        yield pb.PrefillEvent(
            first=pb.PrefillFirst(stats=stats, first_token_id=first_token_id, text=text)
        )
        # The decode worker reads these blocks next. A put that failed is logged by the
        # connector; the decode worker then computes that block, so the answer is unchanged.
        await self.engine.flush()
        self.turns.progress()
        table, token_ids = result.sequence.table, result.sequence.token_ids
        tail = await complete(asyncio.to_thread(tail_kv, self.engine.cache, table, len(token_ids)))
        handoff = self._handoff_message(request, token_ids, tail, first_token_id, sampler)
        yield pb.PrefillEvent(handoff=handoff)

    def _stats(self, result: PrefillResult, start_s: float, busy_start_s: float) -> pb.PrefillStats:
        """The prefill's stats for the router (counted in this worker's metrics too)."""
        layout = self.engine.layout
        fetch_bytes = result.num_cached_tokens // layout.block_tokens * layout.block_bytes
        now_s = time.perf_counter()
        stats = pb.PrefillStats(
            worker_id=self.worker_id,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
            num_computed_tokens=result.num_computed_tokens,
            num_matched_tokens=result.num_matched_tokens,
            prefill_s=now_s - start_s,
            busy_s=now_s - busy_start_s,
            fetch_bytes=fetch_bytes,
            fallback=result.fallback or "",
        )
        self.metrics.prefill_time.observe(result.ttft_s)
        self.metrics.prefilled(
            result.num_computed_tokens, result.num_cached_tokens, fetch_bytes, stats.fallback
        )
        return stats

    def _handoff_message(
        self,
        request: pb.PrefillRequest,
        token_ids: list[int],
        tail: bytes,
        first_token_id: int,
        sampler: Sampler,
    ) -> pb.Handoff:
        """What the decode worker needs besides the store's blocks (see ``handoff.py``)."""
        block_tokens = self.engine.config.block_tokens
        return pb.Handoff(
            request_id=request.request_id,
            tenant=request.tenant,
            traffic_class=request.traffic_class,
            token_ids=token_ids,
            num_stored_blocks=len(token_ids) // block_tokens,
            tail_kv=tail,
            tail_tokens=len(token_ids) % block_tokens,
            first_token_id=first_token_id,
            sampler_state=sampler_state(sampler),
            cache_salt=request.cache_salt,
            **handoff_layout(self.engine),
        )
