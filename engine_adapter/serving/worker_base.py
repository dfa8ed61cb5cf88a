"""What the prefill and decode workers share: identity, the engine, request checks, load,
Health, and an await that survives cancellation.

A worker serves one request at a time (requests queue on a lock; torch runs off the event
loop, so Health answers during a prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from engine_adapter.engine import Engine
from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.balancer import PrefillSample
from engine_adapter.serving.metrics import WorkerMetrics
from kvstore.config import load_cluster
from kvstore.errors import ERRORS, InvalidArgument
from kvstore.grpc_errors import to_grpc_status
from ttl.policy import TrafficClasses

log = logging.getLogger(__name__)

T = TypeVar("T")


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
