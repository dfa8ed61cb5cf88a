"""What the prefill and decode workers share: identity, the engine, request checks, load,
Health, and an await that survives cancellation.

A worker serves one request at a time (requests queue for the engine, ``engine_turns.py``;
torch runs off the event loop, so Health answers during a prefill, which is how the router
tells busy from hung). An engine held with no progress for longer than a request's deadline
is a wedge: Health then answers ``not_serving`` with the reason, the worker logs it, and the
router sends it nothing until it moves again.
With TLS a worker takes calls only from the serving certificate (``worker_tls.py``).

Before a prefill, a worker asks the store whether the serving tier's credential may act for
the request's tenant (:class:`TenantAccess`): with auth on, a tenant missing from the
service principal's allow-list would otherwise be served silently without the cache (every
lookup refused, every write-back dropped); it is refused instead, naming the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from engine_adapter.engine import Engine
from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S
from engine_adapter.serving.balancer import PrefillSample
from engine_adapter.serving.engine_turns import EngineTurns
from engine_adapter.serving.errors import TenantNotAllowed
from engine_adapter.serving.metrics import WorkerMetrics
from engine_adapter.serving.worker_tls import check_peer
from kvstore.config import load_cluster
from kvstore.errors import ERRORS, InvalidArgument, KVStoreError, PermissionDenied
from kvstore.grpc_errors import to_grpc_status
from ttl.policy import TrafficClasses

log = logging.getLogger(__name__)

T = TypeVar("T")

ACCESS_ALLOWED_TTL_S = 30.0  # an allowed tenant is asked again after this
ACCESS_REFUSED_TTL_S = 2.0  # a refused one sooner: an allow-list change takes about a second
ACCESS_CHECK_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 1.0  # how often a worker looks for a wedged engine, to log it
_PROBE_KEY = bytes(16)  # any key: the question is whether the nodes take the credential


class TenantAccess:
    """Whether the store takes this worker's credential for a tenant, remembered a while."""

    def __init__(self) -> None:
        self._tenant_to_answer: dict[str, tuple[bool, float]] = {}  # (allowed, asked at)

    async def check(self, engine: Engine, tenant: str) -> None:
        """TenantNotAllowed if the nodes refuse the serving tier's credential for ``tenant``.
        A store that does not answer counts as allowed (the cache may then miss)."""
        allowed, asked_s = self._tenant_to_answer.get(tenant, (True, -1e9))
        ttl_s = ACCESS_ALLOWED_TTL_S if allowed else ACCESS_REFUSED_TTL_S
        if time.monotonic() - asked_s > ttl_s:
            allowed = await self._ask(engine, tenant)
            self._tenant_to_answer[tenant] = (allowed, time.monotonic())
        if not allowed:
            raise TenantNotAllowed(
                f"the store refuses the serving tier's credential for tenant {tenant!r} (the "
                "API key's tenant): add it to the service principal's allow-list (kvstore "
                f"cluster add-tenant NAME --role service --tenants ...,{tenant}) or map the "
                "key to a tenant it may act for"
            )

    @staticmethod
    async def _ask(engine: Engine, tenant: str) -> bool:
        if engine.connector is None:
            return True
        try:
            client = await engine.connector.client(tenant)
            await client.contains([_PROBE_KEY], timeout_s=ACCESS_CHECK_TIMEOUT_S)
        except PermissionDenied:
            return False
        except (KVStoreError, OSError) as exc:
            log.warning("could not ask the store about tenant %r: %s", tenant, exc)
        return True


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
        stall_after_s: float = DEFAULT_TIMEOUT_S,
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
        # One request holds the engine's KV pool at a time; the others queue (FIFO).
        self.turns = EngineTurns(self.metrics.waiting, self.metrics.running)
        self.stall_after_s = stall_after_s  # held this long with no progress: wedged
        self.draining = asyncio.Event()  # set: no new requests
        self.drain_requested = asyncio.Event()  # a Drain RPC came: exit once drained
        self._classes: TrafficClasses | None = None
        self.peer_identity: str | None = None  # TLS: the one client certificate taken
        self.tenant_access = TenantAccess()

    def start_drain(self, grace_s: float) -> None:
        """Take no new requests (requests queued for the engine leave at once)."""
        self.draining.set()
        self.turns.close()

    async def drained(self) -> None:
        """Wait until no request is left on this worker."""
        while self.num_active:
            await asyncio.sleep(0.05)

    async def check_caller(self, context: grpc.aio.ServicerContext) -> None:
        """Abort the call unless it comes from the serving certificate (with TLS)."""
        try:
            check_peer(context, self.peer_identity)
        except PermissionDenied as exc:
            await context.abort(*to_grpc_status(exc))

    async def Health(  # gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthReply:
        await self.check_caller(context)
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
            not_serving=self.not_serving(),
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
        drains before that: the request has not started here and belongs elsewhere. Every
        count and the engine are given back by ``with`` blocks, however the request ends.
        """
        await self.check_caller(context)
        with self._active():
            try:
                async with self.turns.turn(request_id) as holds:
                    if holds:
                        await asyncio.sleep(self.inject_delay_s)
                    yield holds
            except ERRORS as exc:
                log.warning(
                    "%s %s: request %s failed: %s", self.role, self.worker_id, request_id, exc
                )
                await context.abort(*to_grpc_status(exc))

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1

    def not_serving(self) -> str:
        """Why this worker takes no work ("" while it does): its engine is wedged."""
        return self.turns.stalled(self.stall_after_s)

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Log when the engine turns wedged and when it moves again (runs until cancelled)."""
        reported = ""
        while True:
            await asyncio.sleep(interval_s)
            reason = self.not_serving()
            if reason and not reported:
                log.error("%s %s: not serving: %s", self.role, self.worker_id, reason)
            elif reported and not reason:
                log.warning("%s %s: serving again: the engine moved", self.role, self.worker_id)
            reported = reason
