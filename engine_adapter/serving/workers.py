"""Prefill and decode worker processes: each runs the engine and serves one gRPC service.

::

    python -m engine_adapter.serving.workers prefill|decode --cluster DIR/cluster.toml --id p0
        [--model default] [--port 0] [--ready-file PATH] [--parent-pid PID]
        [--store-transport grpc|auto|ucx] [--metrics-port 0] [--drain-grace-s 60]
        [--calibration-tokens 64,256,512] [--prefill-step-budget-ms 0]

The handoff, through the store::

    prefill worker                                      decode worker
    Engine.prefill: lookup, swap in the cached
    blocks, compute the rest, write back the new ones
    sample the first token --PrefillFirst--> router
    wait for the write-back (Engine.flush)
    tail KV, token ids, sampler state
                           --Handoff------->  router --Decode(Handoff)--> fetch every full
                                                                          block ("always"), compute
                                                                          any the store lost, load
                                                                          the tail KV, then decode
                                                                          one token at a time

Drain (``Drain`` RPC or SIGTERM) of a decode worker, the same path the other way::

    decode worker d0 (draining)                          decode worker d1
    no new requests; queued ones: migrate(Handoff as it came)
    after the grace: put the new full blocks (prompt
    and generated tokens), tail KV, sampler state
                           --migrate(Handoff)--> router --Decode(Handoff)--> as above, then
                                                                          decode on from the last
                                                                          sampled token

Both roles run :class:`engine_adapter.engine.Engine` (model, paged KV, store connector); the
decode worker's connector always fetches (its KV must come from the store) and writes only
when a drain moves a request. A worker serves one request at a time (requests queue on a
lock; torch runs off the event loop, so Health answers during a prefill). A prefill worker
first times a few cold prefills (``--calibration-tokens``), which its Health reply carries to
the router's cost model. A worker writes ``--ready-file`` (JSON: id, role, address, pid,
model fingerprint) once it serves, serves Prometheus metrics on ``--metrics-port``, and
exits when its parent dies (so a killed ``kvstore serve`` leaves no workers behind), on
SIGINT, or after a drain (SIGTERM or the RPC) has moved or finished every request; it exits
0 then, which ``kvstore serve`` takes as "do not restart".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from prometheus_client import start_http_server

from engine_adapter.config import EngineConfig, add_store_transport_argument
from engine_adapter.connector import FetchOutcome
from engine_adapter.engine import Engine, PrefillResult, Sampler, block_key_salt
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from engine_adapter.serving.balancer import PrefillCostModel, PrefillSample
from engine_adapter.serving.metrics import WorkerMetrics
from engine_adapter.serving.router import CHANNEL_OPTIONS
from kvstore.cli.args import duration_arg, list_arg
from kvstore.config import load_cluster
from kvstore.errors import ERRORS, InvalidArgument, Unavailable
from kvstore.grpc_errors import to_grpc_status
from ttl.policy import TrafficClasses

log = logging.getLogger(__name__)

T = TypeVar("T")
ROLES = ("prefill", "decode")
PARENT_POLL_S = 0.5
STOP_GRACE_S = 2.0
DEFAULT_DRAIN_GRACE_S = 60.0
DEFAULT_CALIBRATION_TOKENS = (64, 256, 512)
DECODE_MIN_FETCH_DEADLINE_S = 1.0


def engine_config(
    role: str,
    block_tokens: int,
    max_model_len: int,
    seed: int,
    fetch_policy: str = "cost",
    store_transport: str = "grpc",
) -> EngineConfig:
    """One sequence at a time; prefill fetches by ``fetch_policy`` and writes back, decode
    always fetches (its KV must come from the store) and never writes.

    A decode worker never prefills, so its cost model never learns the compute rate that
    sets fetch deadlines; a floor of DECODE_MIN_FETCH_DEADLINE_S keeps a busy machine from
    turning its swap-in into a recompute.
    """
    is_prefill = role == "prefill"
    defaults = EngineConfig()
    return EngineConfig(
        block_tokens=block_tokens,
        prefill_chunk_tokens=block_tokens,
        max_num_seqs=1,
        max_model_len=max_model_len,
        fetch_policy=fetch_policy if is_prefill else "always",
        fetch_min_deadline_s=(
            defaults.fetch_min_deadline_s if is_prefill else DECODE_MIN_FETCH_DEADLINE_S
        ),
        write_back=is_prefill,
        store_transport=store_transport,
        seed=seed,
    )


async def complete(
    awaitable: Awaitable[T], abandon: Callable[[T], object] = lambda result: None
) -> T:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile.

    A cancelled RPC must not free its KV blocks while a compute thread still writes them (a
    thread cannot be stopped): the next request would get those blocks and could read, or
    write back to the store, KV that is not its own. So the work always finishes; on
    cancellation ``abandon(result)`` then releases what it produced, and the cancellation
    propagates.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is None:
            abandon(task.result())
        raise


def make_sampler(sampling: pb.SamplingParams, state: bytes = b"") -> Sampler:
    """The engine's sampler for ``sampling``, resumed from a handoff's RNG ``state``."""
    sampler = Sampler(sampling.temperature, sampling.top_k, sampling.seed, sampling.top_p or 1.0)
    if state:
        sampler.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return sampler


def sampler_state(sampler: Sampler) -> bytes:
    return _tensor_bytes(sampler.generator.get_state())


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def tail_kv(cache: PagedKVCache, table: BlockTable, num_tokens: int) -> bytes:
    """KV of the positions after the last full block, ``[L, 2, Hkv, tail, D]`` as bytes."""
    block_tokens, tail = cache.layout.block_tokens, num_tokens % cache.layout.block_tokens
    if tail == 0:
        return b""
    block_id = table.block_ids[num_tokens // block_tokens]
    layers = [cache.block(layer, block_id)[:, :, :tail] for layer in range(cache.layout.num_layers)]
    return _tensor_bytes(torch.stack(layers))  # [L, 2, Hkv, tail, D]


def load_tail_kv(cache: PagedKVCache, table: BlockTable, num_tokens: int, data: bytes) -> None:
    """Inverse of :func:`tail_kv`: place the tail's KV into the table's last block."""
    lay = cache.layout
    tail = num_tokens % lay.block_tokens
    expected_bytes = lay.block_bytes // lay.block_tokens * tail
    if len(data) != expected_bytes:
        raise InvalidArgument(
            f"handoff tail KV is {len(data)} bytes, expected {expected_bytes} for {tail} tokens "
            "of this model's layout; run prefill and decode workers with the same --model"
        )
    if tail == 0:
        return
    kv = torch.frombuffer(bytearray(data), dtype=getattr(torch, lay.dtype))
    kv = kv.view(lay.num_layers, 2, lay.num_kv_heads, tail, lay.head_dim)  # [L, 2, Hkv, tail, D]
    block_id = table.block_ids[num_tokens // lay.block_tokens]
    for layer in range(lay.num_layers):
        cache.block(layer, block_id)[:, :, :tail].copy_(kv[layer].to(cache.kv.device))


class WorkerBase:
    """What both roles share: identity, the engine, request checks, load, Health."""

    role = ""

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        cluster_toml: Path,
        inject_delay_s: float = 0.0,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.cluster_toml = cluster_toml
        # Test-only: a slow worker (per request, and per token when decoding), to kill mid-request.
        self.inject_delay_s = inject_delay_s
        self.metrics = metrics or WorkerMetrics()
        self.metrics_address = ""
        self.calibration: list[PrefillSample] = []
        self.num_active = 0
        self.lock = asyncio.Lock()  # one request holds the engine's KV pool at a time
        self.draining = asyncio.Event()  # set: no new requests
        self.drain_requested = asyncio.Event()  # a Drain RPC came: exit once drained
        self._classes: TrafficClasses | None = None

    def start_drain(self, grace_s: float) -> None:
        """Take no new requests (requests queued for the engine leave at once)."""
        self.draining.set()

    async def drained(self) -> None:
        """Wait until no request is left on this worker."""
        while self.num_active:
            await asyncio.sleep(0.05)

    async def Health(  # gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthReply:
        return pb.HealthReply(
            worker_id=self.worker_id,
            role=self.role,
            model_fingerprint=self.engine.loaded.fingerprint,
            num_active=self.num_active,
            pid=os.getpid(),
            draining=self.draining.is_set(),
            max_model_len=self.engine.max_model_len,
            calibration_tokens=[s.num_new_tokens for s in self.calibration],
            calibration_s=[s.seconds for s in self.calibration],
            prefill_chunk_tokens=self.engine.config.prefill_chunk_tokens,
            metrics_address=self.metrics_address,
        )

    async def check_traffic_class(self, traffic_class: str) -> None:
        """UnknownTrafficClass unless the cluster defines ``traffic_class``."""
        if self._classes is None:  # read late: the cluster may start after the workers
            config = await asyncio.to_thread(load_cluster, self.cluster_toml)
            self._classes = config.ttl.classes
        self._classes.check(traffic_class)

    def check_length(self, num_prompt_tokens: int, sampling: pb.SamplingParams) -> int:
        """Tokens that need KV (the last generated token never does); raise if too many."""
        num_tokens = num_prompt_tokens + max(sampling.max_new_tokens, 1) - 1
        if num_tokens > self.engine.max_model_len:
            raise InvalidArgument(
                f"{num_prompt_tokens} prompt tokens + max_new_tokens {sampling.max_new_tokens} "
                f"exceed max_model_len {self.engine.max_model_len}; shorten the request "
                "or start the workers with a larger --max-model-len"
            )
        return num_tokens

    def text(self, token_ids: Sequence[int]) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids) if tokenizer is not None else ""

    @contextlib.asynccontextmanager
    async def serving(
        self, context: grpc.aio.ServicerContext, request_id: str
    ) -> AsyncIterator[bool]:
        """Count the request, hold the engine, and turn kvstore errors into gRPC statuses.

        Yields True once the request holds the engine, or False (at once) if the worker
        drains before that: the request has not started here and belongs elsewhere.
        """
        self.num_active += 1
        self.metrics.waiting.inc()
        holds = False
        try:
            holds = await self._acquire_unless_draining()
            self.metrics.waiting.dec()
            if holds:
                self.metrics.running.inc()
                await asyncio.sleep(self.inject_delay_s)
            yield holds
        except ERRORS as exc:
            log.warning("%s %s: request %s failed: %s", self.role, self.worker_id, request_id, exc)
            await context.abort(*to_grpc_status(exc))
        finally:
            if holds:
                self.lock.release()
                self.metrics.running.dec()
            self.num_active -= 1

    async def _acquire_unless_draining(self) -> bool:
        """Wait for the engine's lock, or until the worker drains (False, lock not held)."""
        if self.draining.is_set():
            return False
        acquire = asyncio.ensure_future(self.lock.acquire())
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait({acquire, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
            if not acquire.done():
                acquire.cancel()
                await asyncio.gather(acquire, return_exceptions=True)
        got_lock = acquire.done() and not acquire.cancelled() and acquire.exception() is None
        if got_lock and self.draining.is_set():
            self.lock.release()
            return False
        return got_lock


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
            try:
                async for event in self._handoff(request, result, start_s, busy_start_s):
                    yield event
            finally:
                self.engine.release(result.sequence)

    def prompt_ids(self, request: pb.PrefillRequest) -> list[int]:
        """The request's token ids, or its conversation through the chat template."""
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return self.engine.encode_prompt(messages)
        return self.engine.encode_prompt(list(request.token_ids))

    async def _handoff(
        self, request: pb.PrefillRequest, result: PrefillResult, start_s: float, busy_start_s: float
    ) -> AsyncIterator[pb.PrefillEvent]:
        """The first token at once; the handoff once the new blocks are in the store."""
        sampler = make_sampler(request.sampling)
        first_token_id = sampler.sample(result.logits)
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
        text = self.text([first_token_id])
        yield pb.PrefillEvent(
            first=pb.PrefillFirst(stats=stats, first_token_id=first_token_id, text=text)
        )
        # The decode worker reads these blocks next. A put that failed is logged by the
        # connector; the decode worker then computes that block, so the answer is unchanged.
        await self.engine.flush()
        table, token_ids = result.sequence.table, result.sequence.token_ids
        tail = await complete(asyncio.to_thread(tail_kv, self.engine.cache, table, len(token_ids)))
        block_tokens = self.engine.config.block_tokens
        yield pb.PrefillEvent(
            handoff=pb.Handoff(
                request_id=request.request_id,
                tenant=request.tenant,
                traffic_class=request.traffic_class,
                model_fingerprint=self.engine.loaded.fingerprint,
                token_ids=token_ids,
                block_tokens=block_tokens,
                num_stored_blocks=len(token_ids) // block_tokens,
                tail_kv=tail,
                tail_tokens=len(token_ids) % block_tokens,
                kv_dtype=self.engine.layout.dtype,
                first_token_id=first_token_id,
                sampler_state=sampler_state(sampler),
                cache_salt=request.cache_salt,
            )
        )


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
            self._check_handoff(handoff)
            num_prompt_tokens = handoff.num_prompt_tokens or len(handoff.token_ids)
            num_tokens = self.check_length(num_prompt_tokens, sampling)
            table = BlockTable(self.engine.config.block_tokens)
            table.block_ids = self.engine.cache.pool.allocate(table.num_blocks_for(num_tokens))
            try:
                async for event in self._decode(handoff, sampling, table):
                    yield event
            finally:
                self.engine.cache.pool.free(table.block_ids)

    def _check_handoff(self, handoff: pb.Handoff) -> None:
        engine = self.engine
        mine = (engine.loaded.fingerprint, engine.config.block_tokens, engine.layout.dtype)
        theirs = (handoff.model_fingerprint, handoff.block_tokens, handoff.kv_dtype)
        if mine != theirs:
            raise InvalidArgument(
                f"handoff from a prefill worker running (model, block_tokens, dtype) = {theirs}; "
                f"this decode worker runs {mine}: start both roles with the same --model"
            )
        if handoff.num_stored_blocks != len(handoff.token_ids) // handoff.block_tokens:
            raise InvalidArgument(
                f"handoff names {handoff.num_stored_blocks} stored blocks for "
                f"{len(handoff.token_ids)} tokens of {handoff.block_tokens}: a malformed handoff"
            )

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


# --- the process main ----------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of one worker process."""
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--cluster", required=True, type=Path, help="the store's cluster.toml")
    parser.add_argument("--id", required=True, help="worker id, e.g. p0 or d0")
    parser.add_argument("--model", default="default", help="default, random:<size>, a .gguf or dir")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument(
        "--ready-file", type=Path, help="write id/address/pid JSON here once serving"
    )
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 suits shared CPUs)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random-init seed (random:<size>)")
    parser.add_argument(
        "--inject-delay-ms", type=float, default=0.0, help="tests: slow requests and tokens"
    )
    add_worker_tuning_arguments(parser)
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: any free port)"
    )


def add_worker_tuning_arguments(parser: argparse.ArgumentParser) -> None:
    """Worker flags that ``kvstore serve`` passes through to its workers (``tuning_argv``)."""
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens per request")
    parser.add_argument(
        "--fetch-policy",
        choices=["cost", "always"],
        default="cost",
        help="prefill: fetch cached blocks when faster than computing them (cost) or always",
    )
    add_store_transport_argument(parser)
    parser.add_argument(
        "--calibration-tokens",
        type=list_arg(int),
        default=DEFAULT_CALIBRATION_TOKENS,
        help="prefill workers time cold prefills of these lengths at start-up, which seed "
        "the router's cost model of them ('' for none)",
    )
    parser.add_argument(
        "--prefill-step-budget-ms",
        type=float,
        default=0.0,
        help="solve the prefill chunk size so that one chunk's step, even at the end of "
        "--max-model-len, fits this many ms by the calibrated cost model (0: one block per "
        "chunk, which keeps every cached block usable)",
    )
    parser.add_argument(
        "--drain-grace-s",
        type=duration_arg,
        default=DEFAULT_DRAIN_GRACE_S,
        help="on SIGTERM a decode worker takes no new requests and moves what still runs "
        "after this many seconds to another decode worker",
    )


def tuning_argv(args: argparse.Namespace) -> list[str]:
    """The worker command line of the flags :func:`add_worker_tuning_arguments` parsed."""
    return [
        *("--max-model-len", str(args.max_model_len), "--fetch-policy", args.fetch_policy),
        *("--store-transport", args.store_transport, "--drain-grace-s", str(args.drain_grace_s)),
        *("--calibration-tokens", ",".join(map(str, args.calibration_tokens))),
        *("--prefill-step-budget-ms", str(args.prefill_step_budget_ms)),
    ]


async def calibrate(engine: Engine, lengths: Sequence[int], seed: int = 0) -> list[PrefillSample]:
    """Time a cold prefill of each length (after one untimed warm-up); no store involved."""
    lengths = [n for n in lengths if 0 < n < engine.max_model_len]
    rng = torch.Generator().manual_seed(seed)
    vocab_size = engine.model.config.vocab_size

    async def timed(num_tokens: int) -> float:
        prompt = torch.randint(vocab_size, (num_tokens,), generator=rng).tolist()
        result = await engine.prefill(prompt, use_cache=False)
        engine.release(result.sequence)
        return result.ttft_s

    if lengths:
        await timed(min(lengths))
    return [PrefillSample(n, 0, await timed(n)) for n in lengths]


async def serve_worker(args: argparse.Namespace) -> None:
    """Load the model, serve until SIGTERM/SIGINT, a finished drain or the parent's death."""
    torch.set_num_threads(args.threads)
    config = engine_config(
        args.role,
        args.block_tokens,
        args.max_model_len,
        args.seed,
        args.fetch_policy,
        args.store_transport,
    )
    engine = await asyncio.to_thread(Engine.load, args.model, config)
    calibration: list[PrefillSample] = []
    if args.role == "prefill":
        calibration = await calibrate(engine, args.calibration_tokens)
        if args.prefill_step_budget_ms > 0 and calibration:
            model = PrefillCostModel(calibration)
            chunk = model.chunk_tokens_for(
                args.prefill_step_budget_ms / 1000, config.block_tokens, engine.max_model_len
            )
            engine.config = dataclasses.replace(engine.config, prefill_chunk_tokens=chunk)
            log.info(
                "prefill chunk of %d tokens fits the %.0f ms step budget",
                chunk,
                args.prefill_step_budget_ms,
            )
    engine.open_store(args.cluster)
    worker_type = PrefillWorker if args.role == "prefill" else DecodeWorker
    worker = worker_type(args.id, engine, args.cluster, args.inject_delay_ms / 1000)
    worker.calibration = calibration
    metrics_server, _ = start_http_server(
        args.metrics_port, addr="127.0.0.1", registry=worker.metrics.registry
    )
    worker.metrics_address = f"127.0.0.1:{metrics_server.server_port}"
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add = (
        pb_grpc.add_PrefillWorkerServicer_to_server
        if args.role == "prefill"
        else pb_grpc.add_DecodeWorkerServicer_to_server
    )
    add(worker, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    signalled = _event_on_signals()
    parent_gone = asyncio.Event()
    watcher = (
        asyncio.create_task(_watch_parent(args.parent_pid, parent_gone))
        if args.parent_pid
        else None
    )
    if args.ready_file:
        _write_ready(args.ready_file, worker, f"127.0.0.1:{port}")
    log.info("%s worker %s serving on 127.0.0.1:%d", args.role, args.id, port)
    await _first_of(signalled, parent_gone, worker.drain_requested)
    if not parent_gone.is_set():  # SIGTERM or a Drain RPC: let what runs here finish or move
        if signalled.is_set():
            worker.start_drain(args.drain_grace_s)
        await _first_of_tasks(worker.drained(), parent_gone.wait())
    if watcher is not None:
        watcher.cancel()
    await server.stop(STOP_GRACE_S)
    metrics_server.shutdown()
    await engine.close()


async def _first_of(*events: asyncio.Event) -> None:
    await _first_of_tasks(*(event.wait() for event in events))


async def _first_of_tasks(*awaitables: Awaitable[object]) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer our parent (it died: we were re-parented)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent process %d is gone; stopping", parent_pid)
    stop.set()


def _write_ready(path: Path, worker: WorkerBase, address: str) -> None:
    info = {
        "worker_id": worker.worker_id,
        "role": worker.role,
        "address": address,
        "pid": os.getpid(),
        "model_fingerprint": worker.engine.loaded.fingerprint,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_adapter.serving.workers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--log-level", default="INFO")
    configure(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.id} %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve_worker(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
