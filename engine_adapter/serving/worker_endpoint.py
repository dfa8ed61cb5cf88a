"""The router's view of one worker (``WorkerEndpoint``: channel, load, health), the workers
of one role (``WorkerSet``: which one takes the next request), and the reading of a worker's
event stream, which tells a busy worker from a hung or wedged one (``read_events``).

A worker is up while its Health answers and does not say ``not_serving``; the router's probe
(``Router``) asks every worker about every second, so one that wedges is taken out and one
that recovers is taken back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument
from kvstore.grpc_errors import from_grpc_status
from kvstore.tls import aio_channel

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 64 << 20),  # a handoff's tail KV can be a few MiB
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
HEALTH_TIMEOUT_S = 2.0
# A silent worker gets this long to answer Health before it counts as hung: generous, as a
# worker's event loop shares 2 busy cores with torch threads under a flood.
LIVENESS_TIMEOUT_S = 5.0
# Failures that say "this worker is gone, hung or draining", not "this request is bad".
WORKER_FAULT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass
class WorkerEndpoint:
    """One worker as the router sees it: channel, stub, load and health."""

    address: str
    role: str  # "prefill" or "decode"
    channel: grpc.aio.Channel
    stub: Any
    worker_id: str = ""
    num_active: int = 0  # requests this router has in flight on the worker
    healthy: bool = True
    draining: bool = False  # takes no new requests (its Health says so)
    last_error: str = ""
    health: pb.HealthReply = field(default_factory=pb.HealthReply)

    @classmethod
    def open(
        cls, address: str, role: str, credentials: grpc.ChannelCredentials | None = None
    ) -> WorkerEndpoint:
        """A channel to the worker at ``address``: TLS when ``credentials`` are given."""
        channel = aio_channel(address, credentials, CHANNEL_OPTIONS)
        stub_type = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
        return cls(address, role, channel, stub_type(channel), worker_id=address)

    def mark_down(self, error: str) -> None:
        if self.healthy:
            log.warning("%s worker %s is down: %s", self.role, self.worker_id, error)
        self.healthy, self.last_error = False, error

    async def probe(self, timeout_s: float = HEALTH_TIMEOUT_S) -> pb.HealthReply | None:
        """The worker's Health reply (and mark it up), or None if it does not answer."""
        try:
            reply = await self.stub.Health(pb.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None
        if reply.role != self.role:
            raise InvalidArgument(
                f"{self.address} is a {reply.role} worker, configured as a {self.role} worker"
            )
        self.worker_id, self.draining, self.health = reply.worker_id, reply.draining, reply
        if reply.not_serving:  # wedged: it answers, but sends nothing for its requests
            self.mark_down(f"not serving: {reply.not_serving}")
        else:
            self.healthy = True
        return reply

    async def answers_health(self) -> bool:
        """Whether the worker still serves (busy computing is not hung; wedged is)."""
        try:
            reply = await self.stub.Health(pb.HealthRequest(), timeout=LIVENESS_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return not reply.not_serving


@dataclass
class WorkerSet:
    """The workers of one role and the policy that picks among them."""

    workers: list[WorkerEndpoint]
    policy: str = "least-loaded"
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: set[str]) -> WorkerEndpoint | None:
        """A healthy worker not in ``exclude`` (by address); None if there is none."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        turn = next(self._turn)
        rotated = candidates[turn % len(candidates) :] + candidates[: turn % len(candidates)]
        if self.policy == "round-robin":
            return rotated[0]
        return min(rotated, key=lambda w: w.num_active)  # min keeps the first of equals

    def candidates(self, exclude: set[str]) -> list[WorkerEndpoint]:
        """Healthy workers that take new requests, not in ``exclude`` (by address)."""
        return [
            w for w in self.workers if w.healthy and not w.draining and w.address not in exclude
        ]

    def states(self) -> str:
        """Each worker's state, e.g. ``d0: draining; d1: down (connection refused)``."""
        return "; ".join(
            f"{w.worker_id}: "
            + ("draining" if w.draining else f"down ({w.last_error})" if not w.healthy else "up")
            for w in self.workers
        )

    def describe(self, addresses: set[str]) -> str:
        return "; ".join(
            f"{w.worker_id}: {w.last_error or 'failed'}"
            for w in self.workers
            if w.address in addresses
        )


class WorkerFault(Exception):
    """A worker failed in a way another worker may not (it died, hung or is unreachable)."""


async def read_events(
    call: Any, worker: WorkerEndpoint, idle_timeout_s: float
) -> AsyncIterator[Any]:
    """Events of a server-streaming call; worker faults become ``WorkerFault``.

    After ``idle_timeout_s`` without an event the worker is asked Health: one that answers
    is busy (queued requests, a long prefill) and is waited for again; one that does not is
    hung (stopped, its process wedged) and is given up on while its stream stays open.
    """
    read: asyncio.Future[Any] | None = None
    try:
        while True:
            # The read is waited for, never cancelled by the wait: cancelling a grpc.aio
            # read cancels the whole call, and a busy worker's call must live on.
            read = asyncio.ensure_future(call.read())
            while not (await asyncio.wait({read}, timeout=idle_timeout_s))[0]:
                if not await worker.answers_health():
                    raise WorkerFault(
                        f"{worker.worker_id} sent nothing for {idle_timeout_s:g} s and did not "
                        f"answer Health within {LIVENESS_TIMEOUT_S:g} s"
                    )
            event = read.result()
            if event is grpc.aio.EOF:
                return
            yield event
    except grpc.aio.AioRpcError as exc:
        if exc.code() in WORKER_FAULT_CODES:
            raise WorkerFault(f"{worker.worker_id}: {exc.code().name}: {exc.details()}") from None
        raise from_grpc_status(exc.code(), exc.details()) from None
    finally:
        if read is not None and not read.done():
            read.cancel()
        call.cancel()
