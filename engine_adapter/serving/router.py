"""The router: sends each request to any prefill worker, then to a decode worker.

No prefix affinity: the store is shared, so whichever prefill worker gets a request finds
the prefix another worker wrote. Workers are picked least-loaded (fewest requests this
router has in flight on them, ties broken round-robin) or plain round-robin. The Python
request interface, in-process or against a running ``kvstore serve``::

    async with Router(prefill_addresses, decode_addresses) as router:        # in-process
        completion = await router.generate(messages, tenant="acme", traffic_class="chat",
                                           max_new_tokens=16, seed=0)
    async with ServingClient("127.0.0.1:8700") as client:                   # remote
        async for event in client.stream(messages, tenant="acme"): ...      # GenerateEvent

Failure handling, with a deadline on every RPC: a prefill attempt that fails with
UNAVAILABLE (the worker died or is unreachable) or passes its attempt deadline marks that
worker down and is retried on another one; prefill is idempotent (blocks are content
addressed), so a retry is safe. A decode stream that breaks mid-request is restarted on
another decode worker from the same handoff; decoding is deterministic (greedy or seeded), so
the tokens already streamed are checked and skipped. With no healthy worker left, the request
fails with ``Unavailable`` naming the workers tried. A background probe brings a worker back
once its Health RPC answers again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from kvstore.errors import ERRORS, DeadlineExceeded, InvalidArgument, Unavailable
from kvstore.grpc_errors import from_grpc_status, to_grpc_status

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 64 << 20),  # a handoff's tail KV can be a few MiB
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
DEFAULT_TIMEOUT_S = 120.0  # a whole request
PREFILL_ATTEMPT_TIMEOUT_S = 60.0  # one prefill attempt (a hung worker is given up on)
TOKEN_TIMEOUT_S = 30.0  # longest silence on a decode stream before the worker counts as hung
HEALTH_TIMEOUT_S = 2.0
PROBE_INTERVAL_S = 1.0
POLICIES = ("least-loaded", "round-robin")

# Failures that say "this worker is gone or hung", not "this request is bad".
_WORKER_FAULT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

Message = Mapping[str, str]


@dataclass
class Completion:
    """One finished request, as the caller of :meth:`Router.generate` sees it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt KV the prefill worker swapped in from the store
    num_matched_tokens: int  # prompt prefix the store held (the cost model may fetch less)
    num_computed_tokens: int  # prompt KV the prefill worker computed
    ttft_s: float  # from the call until the first token arrived, measured by the caller
    total_s: float
    prefill_worker_id: str
    decode_worker_id: str
    num_prefill_attempts: int
    num_swapped_tokens: int  # prompt KV the decode worker read from the store
    num_recomputed_tokens: int  # prompt KV the decode worker computed (blocks unreadable)


def make_request(
    messages: Sequence[Message] | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    tenant: str = "default",
    traffic_class: str = "chat",
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    ignore_eos: bool = False,
    timeout_s: float = 0.0,
    request_id: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest for a conversation (``messages``) or a prompt's ``token_ids``."""
    if (messages is None) == (token_ids is None):
        raise InvalidArgument("pass either messages=[{'role':..., 'content':...}] or token_ids")
    request = pb.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex[:12],
        tenant=tenant,
        traffic_class=traffic_class,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
        token_ids=list(token_ids or ()),
        sampling=pb.SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            ignore_eos=ignore_eos,
        ),
        timeout_s=timeout_s,
    )
    check_request(request)
    return request


def check_request(request: pb.GenerateRequest) -> None:
    """InvalidArgument for a request no worker could serve (checked before routing it)."""
    sampling = request.sampling
    if bool(request.messages) == bool(request.token_ids):
        raise InvalidArgument("a request needs a non-empty conversation or prompt token ids")
    if not request.tenant or not request.traffic_class:
        raise InvalidArgument("a request needs a tenant and a traffic class, e.g. acme / chat")
    if sampling.max_new_tokens < 1 or sampling.temperature < 0:
        raise InvalidArgument(
            f"need max_new_tokens >= 1 and temperature >= 0; got "
            f"{sampling.max_new_tokens}, {sampling.temperature}"
        )


async def collect(request_id: str, events: AsyncIterator[pb.GenerateEvent]) -> Completion:
    """Drain a GenerateEvent stream into a :class:`Completion` (TTFT measured here)."""
    start_s = time.perf_counter()
    ttft_s, stats, token_ids = 0.0, pb.PrefillStats(), []
    async for event in events:
        kind = event.WhichOneof("event")
        if kind == "prefill":
            stats = event.prefill
        elif kind == "token":
            ttft_s = ttft_s or time.perf_counter() - start_s
            token_ids.append(event.token.token_id)
        else:
            return _completion(request_id, stats, event.finish, token_ids, ttft_s, start_s)
    raise Unavailable(f"request {request_id}: the event stream ended without a finish event")


def _completion(
    request_id: str,
    stats: pb.PrefillStats,
    finish: pb.Finish,
    token_ids: list[int],
    ttft_s: float,
    start_s: float,
) -> Completion:
    return Completion(
        request_id=request_id,
        token_ids=token_ids,
        text=finish.text,
        finish_reason=finish.finish_reason,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_cached_tokens=stats.num_cached_tokens,
        num_matched_tokens=stats.num_matched_tokens,
        num_computed_tokens=stats.num_computed_tokens,
        ttft_s=ttft_s,
        total_s=time.perf_counter() - start_s,
        prefill_worker_id=stats.worker_id,
        decode_worker_id=finish.decode_worker_id,
        num_prefill_attempts=stats.num_attempts,
        num_swapped_tokens=finish.num_swapped_tokens,
        num_recomputed_tokens=finish.num_recomputed_tokens,
    )


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
    last_error: str = ""

    @classmethod
    def open(cls, address: str, role: str) -> WorkerEndpoint:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
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
        self.worker_id, self.healthy = reply.worker_id, True
        return reply


@dataclass
class WorkerSet:
    """The workers of one role and the policy that picks among them."""

    workers: list[WorkerEndpoint]
    policy: str = "least-loaded"
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: set[str]) -> WorkerEndpoint | None:
        """A healthy worker not in ``exclude`` (by address); None if there is none."""
        candidates = [w for w in self.workers if w.healthy and w.address not in exclude]
        if not candidates:
            return None
        turn = next(self._turn)
        rotated = candidates[turn % len(candidates) :] + candidates[: turn % len(candidates)]
        if self.policy == "round-robin":
            return rotated[0]
        return min(rotated, key=lambda w: w.num_active)  # min keeps the first of equals

    def describe(self, addresses: set[str]) -> str:
        return "; ".join(
            f"{w.worker_id}: {w.last_error or 'failed'}"
            for w in self.workers
            if w.address in addresses
        )


class _WorkerFault(Exception):
    """A worker failed in a way another worker may not (it died, hung or is unreachable)."""


class RequestAPI:
    """``generate`` and ``stream``, shared by the in-process :class:`Router` and the remote
    :class:`ServingClient`; subclasses implement ``stream_request``."""

    def stream_request(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        raise NotImplementedError

    async def generate(
        self,
        messages: Sequence[Message] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        tenant: str = "default",
        traffic_class: str = "chat",
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        ignore_eos: bool = False,
        timeout_s: float = 0.0,
        request_id: str = "",
    ) -> Completion:
        """Run one request to completion (arguments as :func:`make_request`)."""
        request = make_request(
            messages,
            token_ids=token_ids,
            tenant=tenant,
            traffic_class=traffic_class,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            ignore_eos=ignore_eos,
            timeout_s=timeout_s,
            request_id=request_id,
        )
        return await collect(request.request_id, self.stream_request(request))

    def stream(
        self, messages: Sequence[Message] | None = None, **kwargs: Any
    ) -> AsyncIterator[pb.GenerateEvent]:
        """Events of one request: ``prefill`` stats, a ``token`` per token, then ``finish``.

        Keyword arguments as :meth:`generate`.
        """
        return self.stream_request(make_request(messages, **kwargs))


class Router(RequestAPI):
    """Routes requests over prefill and decode worker processes (see the module doc)."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        *,
        policy: str = "least-loaded",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prefill_attempt_timeout_s: float = PREFILL_ATTEMPT_TIMEOUT_S,
        token_timeout_s: float = TOKEN_TIMEOUT_S,
    ) -> None:
        if not prefill_addresses or not decode_addresses:
            raise InvalidArgument("a router needs at least one prefill and one decode worker")
        if policy not in POLICIES:
            raise InvalidArgument(f"routing policy {policy!r}: choose one of {POLICIES}")
        self.prefill = WorkerSet(
            [WorkerEndpoint.open(a, "prefill") for a in prefill_addresses], policy
        )
        self.decode = WorkerSet(
            [WorkerEndpoint.open(a, "decode") for a in decode_addresses], policy
        )
        self.timeout_s = timeout_s
        self.prefill_attempt_timeout_s = prefill_attempt_timeout_s
        self.token_timeout_s = token_timeout_s
        self._probe_task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> list[WorkerEndpoint]:
        return self.prefill.workers + self.decode.workers

    async def start(self, timeout_s: float = 30.0) -> None:
        """Wait until every worker answers Health, then keep probing the ones that fail."""
        deadline_s = time.monotonic() + timeout_s
        for worker in self.endpoints:
            while await worker.probe() is None:
                if time.monotonic() > deadline_s:
                    raise Unavailable(
                        f"{worker.role} worker at {worker.address} did not answer Health "
                        f"within {timeout_s} s; is it running (see its log)?"
                    )
                await asyncio.sleep(0.1)
        self._probe_task = asyncio.create_task(self._probe_down_workers())

    async def _probe_down_workers(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            down = [w for w in self.endpoints if not w.healthy]
            if down:
                await asyncio.gather(*(w.probe() for w in down), return_exceptions=True)

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.endpoints))

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def stream_request(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        """Run ``request`` through a prefill worker, then a decode worker, streaming events."""
        check_request(request)
        deadline_s = time.monotonic() + (request.timeout_s or self.timeout_s)
        prefill_request = pb.PrefillRequest(
            request_id=request.request_id,
            tenant=request.tenant,
            traffic_class=request.traffic_class,
            messages=request.messages,
            token_ids=request.token_ids,
            sampling=request.sampling,
        )
        handoff = pb.Handoff()
        async for event in self._prefill(prefill_request, deadline_s):
            if isinstance(event, pb.Handoff):
                handoff = event
            else:
                yield event
        decode_request = pb.DecodeRequest(handoff=handoff, sampling=request.sampling)
        async for event in self._decode(decode_request, deadline_s):
            yield event

    async def _prefill(
        self, request: pb.PrefillRequest, deadline_s: float
    ) -> AsyncIterator[pb.GenerateEvent | pb.Handoff]:
        """GenerateEvents for the first token, then the Handoff; retried on worker faults."""
        tried: set[str] = set()
        first_token_id: int | None = None
        while True:
            worker = self._pick(self.prefill, tried, request.request_id)
            tried.add(worker.address)
            try:
                async for event in self._prefill_attempt(worker, request, deadline_s):
                    if isinstance(event, pb.Handoff):
                        yield event
                        return
                    if first_token_id is None:
                        first_token_id = event.first_token_id
                        event.stats.num_attempts = len(tried)
                        yield pb.GenerateEvent(prefill=event.stats)
                        token = pb.TokenDelta(token_id=event.first_token_id, text=event.text)
                        yield pb.GenerateEvent(token=token)
                    elif event.first_token_id != first_token_id:
                        raise Unavailable(
                            f"request {request.request_id}: prefill retry on {worker.worker_id} "
                            f"sampled token {event.first_token_id}, the first attempt "
                            f"{first_token_id}; workers disagree (different models or seeds?)"
                        )
            except _WorkerFault as exc:
                _remaining_s(deadline_s, request.request_id)  # the request's own deadline?
                worker.mark_down(str(exc))
                log.warning("request %s: retrying prefill: %s", request.request_id, exc)

    async def _prefill_attempt(
        self, worker: WorkerEndpoint, request: pb.PrefillRequest, deadline_s: float
    ) -> AsyncIterator[pb.PrefillFirst | pb.Handoff]:
        timeout_s = min(
            _remaining_s(deadline_s, request.request_id), self.prefill_attempt_timeout_s
        )
        worker.num_active += 1
        try:
            call = worker.stub.Prefill(request, timeout=timeout_s)
            async for event in _read_events(call, worker, timeout_s):
                yield getattr(event, event.WhichOneof("event"))
        finally:
            worker.num_active -= 1

    async def _decode(
        self, request: pb.DecodeRequest, deadline_s: float
    ) -> AsyncIterator[pb.GenerateEvent]:
        """Token events then the finish event; restarted on another worker on a fault."""
        tried: set[str] = set()
        streamed: list[int] = []  # token ids already sent to the caller
        while True:
            worker = self._pick(self.decode, tried, request.handoff.request_id)
            tried.add(worker.address)
            position = 0
            try:
                async for event in self._decode_attempt(worker, request, deadline_s):
                    if event.WhichOneof("event") == "finish":
                        yield pb.GenerateEvent(finish=event.finish)
                        return
                    position = _check_replay(streamed, position, event.token.token_id, worker)
                    if position > len(streamed):
                        streamed.append(event.token.token_id)
                        yield pb.GenerateEvent(token=event.token)
            except _WorkerFault as exc:
                _remaining_s(deadline_s, request.handoff.request_id)
                worker.mark_down(str(exc))
                log.warning("request %s: restarting decode: %s", request.handoff.request_id, exc)

    async def _decode_attempt(
        self, worker: WorkerEndpoint, request: pb.DecodeRequest, deadline_s: float
    ) -> AsyncIterator[pb.DecodeEvent]:
        timeout_s = _remaining_s(deadline_s, request.handoff.request_id)
        worker.num_active += 1
        try:
            call = worker.stub.Decode(request, timeout=timeout_s)
            async for event in _read_events(call, worker, self.token_timeout_s):
                yield event
        finally:
            worker.num_active -= 1

    def _pick(self, workers: WorkerSet, tried: set[str], request_id: str) -> WorkerEndpoint:
        worker = workers.pick(tried)
        if worker is None:
            role = workers.workers[0].role
            raise Unavailable(
                f"request {request_id}: no healthy {role} worker left to try "
                f"(tried: {workers.describe(tried) or 'none'}); check the workers' logs"
            )
        return worker


def _remaining_s(deadline_s: float, request_id: str) -> float:
    remaining_s = deadline_s - time.monotonic()
    if remaining_s <= 0:
        raise DeadlineExceeded(f"request {request_id} passed its deadline; raise timeout_s")
    return remaining_s


def _check_replay(streamed: list[int], position: int, token_id: int, worker: WorkerEndpoint) -> int:
    """Position after ``token_id``; a restarted decode must repeat the tokens already sent."""
    if position < len(streamed) and streamed[position] != token_id:
        raise Unavailable(
            f"decode restarted on {worker.worker_id} produced token {token_id} at position "
            f"{position}, the first attempt {streamed[position]}: decoding is not deterministic"
        )
    return position + 1


async def _read_events(
    call: Any, worker: WorkerEndpoint, idle_timeout_s: float
) -> AsyncIterator[Any]:
    """Events of a server-streaming call; worker faults become ``_WorkerFault``.

    ``idle_timeout_s`` bounds the silence between two events: a hung worker (stopped, stuck
    in a loop) is given up on even while its stream stays open.
    """
    try:
        while True:
            async with asyncio.timeout(idle_timeout_s):
                event = await call.read()
            if event is grpc.aio.EOF:
                return
            yield event
    except TimeoutError:
        call.cancel()
        raise _WorkerFault(f"{worker.worker_id} sent nothing for {idle_timeout_s} s") from None
    except grpc.aio.AioRpcError as exc:
        if exc.code() in _WORKER_FAULT_CODES:
            raise _WorkerFault(f"{worker.worker_id}: {exc.code().name}: {exc.details()}") from None
        raise from_grpc_status(exc.code(), exc.details()) from None
    finally:
        call.cancel()


class RouterService(pb_grpc.RouterServicer):
    """The router's gRPC face (``kvstore serve --port``): Generate streams GenerateEvents."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(  # gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex[:12]
        try:
            async for event in self.router.stream_request(request):
                yield event
        except ERRORS as exc:
            await context.abort(*to_grpc_status(exc))

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthReply:
        num_active = sum(w.num_active for w in self.router.prefill.workers)
        return pb.HealthReply(worker_id="router", role="router", num_active=num_active)


class ServingClient(RequestAPI):
    """Python client of a running router (``kvstore serve --port P``)."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.RouterStub(self.channel)

    async def __aenter__(self) -> ServingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def stream_request(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        timeout_s = (request.timeout_s or self.timeout_s) + 5.0  # the router enforces the deadline
        call = self.stub.Generate(request, timeout=timeout_s)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_status(exc.code(), exc.details()) from None
