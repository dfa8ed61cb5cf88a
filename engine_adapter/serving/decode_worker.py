"""The decode worker: swap the prompt's KV in from the store plus the handoff's tail, then
decode one token at a time.

Its connector always fetches (its KV must come from the store) and writes only when a drain
moves a request. Drain (``Drain`` RPC or SIGTERM), the handoff the other way::

    decode worker d0 (draining)                          decode worker d1
    no new requests; queued ones: migrate(Handoff as it came)
    after the grace: put the new full blocks (prompt
    and generated tokens), tail KV, sampler state
                           --migrate(Handoff)--> router --Decode(Handoff)--> as from a
                                                                          prefill (handoff.py),
                                                                          then decode on from the
                                                                          last sampled token
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch

from engine_adapter.connector import FetchOutcome
from engine_adapter.engine import Sampler, block_key_salt
from engine_adapter.paged_kv import BlockTable
from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from engine_adapter.serving.handoff import (
    check_handoff,
    load_tail_kv,
    make_sampler,
    sampler_state,
    tail_kv,
)
from engine_adapter.serving.worker_base import WorkerBase, complete

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase, pb_grpc.DecodeWorkerServicer):
    """Swap the prompt's KV in from the store plus the handoff's tail, then decode."""

    role = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.migrate_now = asyncio.Event()  # set when a drain's grace is over
        self._grace_timer: asyncio.TimerHandle | None = None

    async def Drain(  # gRPC method name
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainReply:
        await self.check_caller(context)
        num_active = self.num_active
        self.start_drain(request.grace_s)
        self.drain_requested.set()
        return pb.DrainReply(num_active=num_active)

    def start_drain(self, grace_s: float) -> None:
        """Take no new requests; after ``grace_s`` hand the running one on (see ``Drain``).

        Requests queued for the engine hand themselves back at once: they have not started.
        """
        if self.draining.is_set():
            return
        log.warning(
            "decode %s: draining; requests still running in %.0f s move", self.worker_id, grace_s
        )
        self.draining.set()
        self.turns.close()
        loop = asyncio.get_running_loop()
        self._grace_timer = loop.call_later(max(grace_s, 0.0), self.migrate_now.set)

    async def Decode(  # gRPC method name
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        handoff, sampling = request.handoff, request.sampling
        async with self.serving(context, handoff.request_id) as holds:
            if not holds:  # draining before it started: it goes elsewhere as it came
                yield pb.DecodeEvent(migrate=handoff)
                return
            check_handoff(handoff, self.engine)
            num_prompt_tokens = handoff.num_prompt_tokens or len(handoff.token_ids)
            num_tokens = self.check_length(num_prompt_tokens, sampling)
            table = BlockTable(self.engine.config.block_tokens)
            table.block_ids = self.engine.cache.pool.allocate(table.num_blocks_for(num_tokens))
            try:
                async for event in self._decode(handoff, sampling, table):
                    yield event
            finally:
                self.engine.cache.pool.free(table.block_ids)

    async def _decode(
        self, handoff: pb.Handoff, sampling: pb.SamplingParams, table: BlockTable
    ) -> AsyncIterator[pb.DecodeEvent]:
        num_prompt_tokens = handoff.num_prompt_tokens or len(handoff.token_ids)
        prompt_ids = list(handoff.token_ids[:num_prompt_tokens])
        generated = [*handoff.token_ids[num_prompt_tokens:], handoff.first_token_id]
        finish = pb.Finish(decode_worker_id=self.worker_id)
        finish.finish_reason = self._stop_reason(generated, sampling)
        if not finish.finish_reason:
            await self._restore_prompt(handoff, table, finish)
            sampler = make_sampler(sampling, handoff.sampler_state)
            async for token in self._generate(prompt_ids, generated, table, sampler, sampling):
                yield pb.DecodeEvent(token=token)
            finish.finish_reason = self._stop_reason(generated, sampling)
            if not finish.finish_reason:  # the grace is over: the request moves on
                migrate = await self._migrate(handoff, prompt_ids, generated, table, sampler)
                yield pb.DecodeEvent(migrate=migrate)
                return
        self.metrics.recomputed_tokens.inc(finish.num_recomputed_tokens)
        finish.text = self.text(generated)
        yield pb.DecodeEvent(finish=finish)

    async def _migrate(
        self,
        handoff: pb.Handoff,
        prompt_ids: list[int],
        generated: list[int],
        table: BlockTable,
        sampler: Sampler,
    ) -> pb.Handoff:
        """The request's handoff to another decode worker, its KV put in the store first.

        Every token but the last generated one has KV here: the new full blocks among them
        go to the store (the prompt's are there already), the tail travels inline. A block
        whose put fails is recomputed by the next worker, so the output stays the same.
        """
        connector = self.engine.connector
        assert connector is not None, "a decode worker opens the store before serving"
        token_ids = prompt_ids + generated[:-1]  # [num_tokens] with KV in this worker
        salt = block_key_salt(handoff.tenant, handoff.cache_salt)
        keys = connector.keys(token_ids, salt)
        await complete(
            connector.write_back(
                keys, table, handoff.num_stored_blocks, handoff.tenant, handoff.traffic_class
            )
        )
        await complete(connector.drain())
        tail = await complete(asyncio.to_thread(tail_kv, self.engine.cache, table, len(token_ids)))
        self.metrics.migrations.inc()
        log.info(
            "decode %s: request %s moves with %d tokens of KV",
            self.worker_id,
            handoff.request_id,
            len(token_ids),
        )
        migrate = pb.Handoff()
        migrate.CopyFrom(handoff)
        migrate.token_ids[:] = token_ids
        migrate.num_prompt_tokens = len(prompt_ids)
        migrate.num_stored_blocks = len(keys)
        migrate.tail_kv = tail
        migrate.tail_tokens = len(token_ids) % self.engine.config.block_tokens
        migrate.first_token_id = generated[-1]
        migrate.sampler_state = sampler_state(sampler)
        return migrate

    def _stop_reason(self, generated: list[int], sampling: pb.SamplingParams) -> str:
        """ "stop" after a stop token, "length" at max_new_tokens, else "" (go on)."""
        if not sampling.ignore_eos and generated[-1] in self._stop_ids():
            return "stop"
        return "length" if len(generated) >= sampling.max_new_tokens else ""

    def _stop_ids(self) -> set[int]:
        """The engine's stop tokens: the model's and the tokenizer's end-of-sequence ids."""
        tokenizer = self.engine.tokenizer
        ids = {self.engine.model.config.eos_token_id}
        ids.add(tokenizer.eos_token_id if tokenizer is not None else None)
        return {i for i in ids if i is not None}

    async def _restore_prompt(
        self, handoff: pb.Handoff, table: BlockTable, finish: pb.Finish
    ) -> None:
        """Swap the full blocks in from the store, compute any it lost, load the tail."""
        connector = self.engine.connector
        assert connector is not None, "a decode worker opens the store before serving"
        token_ids = list(handoff.token_ids)
        keys = connector.keys(token_ids, block_key_salt(handoff.tenant, handoff.cache_salt))
        fetch = connector.fetch_prefix(keys, table, len(keys), handoff.tenant)
        outcome = await complete(fetch, connector.release)
        self.turns.progress()
        try:
            place = asyncio.to_thread(self._place_and_compute, token_ids, table, outcome, len(keys))
            await complete(place)
        finally:
            connector.release(outcome)
        cache = self.engine.cache
        tail = asyncio.to_thread(load_tail_kv, cache, table, len(token_ids), handoff.tail_kv)
        await complete(tail)
        block_tokens = self.engine.config.block_tokens
        finish.num_swapped_tokens = outcome.num_fetched_blocks * block_tokens
        finish.num_recomputed_tokens = (len(keys) - outcome.num_fetched_blocks) * block_tokens

    def _place_and_compute(
        self, token_ids: list[int], table: BlockTable, outcome: FetchOutcome, num_blocks: int
    ) -> None:
        """Place every fetched layer, then compute the full blocks the fetch did not bring.

        Those are whole chunks from a chunk boundary, as in the engine's prefill, so the
        recomputed KV equals what the prefill worker computed.
        """
        for layer in range(self.engine.layout.num_layers):
            outcome.swap_in.before_layer(layer)
        block_tokens = self.engine.config.block_tokens
        start, end = outcome.num_fetched_blocks * block_tokens, num_blocks * block_tokens
        if start < end:
            log.warning(
                "decode %s: computing %d prompt tokens the store did not return",
                self.worker_id,
                end - start,
            )
        ids = torch.tensor(token_ids[:end], dtype=torch.long, device=self.engine.cache.kv.device)
        chunk_tokens = self.engine.config.prefill_chunk_tokens
        for chunk_start in range(start, end, chunk_tokens):
            chunk = ids[chunk_start : chunk_start + chunk_tokens]
            self.engine.model(chunk, chunk_start, self.engine.cache, table)

    async def _generate(
        self,
        prompt_ids: list[int],
        generated: list[int],
        table: BlockTable,
        sampler: Sampler,
        sampling: pb.SamplingParams,
    ) -> AsyncIterator[pb.TokenDelta]:
        """Sample tokens after the first until a stop, or until a drain's grace is over;
        ``generated`` grows in place."""
        text = self.text(generated)
        while not self._stop_reason(generated, sampling) and not self.migrate_now.is_set():
            position = len(prompt_ids) + len(generated) - 1
            await asyncio.sleep(self.inject_delay_s)
            step = asyncio.to_thread(self._step, generated[-1], position, table)
            logits = await complete(step)
            generated.append(sampler.sample(logits))
            self.turns.progress()
            self.metrics.generation_tokens.inc()
            text, delta = self._text_delta(generated, text)
            yield pb.TokenDelta(token_id=generated[-1], text=delta)

    def _step(self, token_id: int, position: int, table: BlockTable) -> torch.Tensor:
        """Forward one token at ``position``; the next token's logits ``[vocab]``."""
        engine = self.engine
        ids = torch.tensor([token_id], dtype=torch.long, device=engine.cache.kv.device)
        return engine.model.logits(engine.model(ids, position, engine.cache, table)[-1])

    def _text_delta(self, generated: list[int], previous: str) -> tuple[str, str]:
        """(text so far, new text); holds back an incomplete UTF-8 character."""
        text = self.text(generated)
        if text.endswith("\ufffd"):
            return previous, ""
        return text, text[len(previous) :]
