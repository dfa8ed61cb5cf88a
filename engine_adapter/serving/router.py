"""The router: sends each request to a prefill worker, then to a decode worker.

No prefix affinity: the store is shared, so whichever prefill worker gets a request finds
the prefix another worker wrote. Prefill workers are picked by the length-aware balancer
(``balanced``, the default: the worker that finishes the request soonest by its fitted cost
model, see ``balancer.py``), by fewest requests in flight (``least-loaded``) or in turn
(``round-robin``); decode workers by fewest requests in flight. The Python interface,
in-process or against a running ``kvstore serve``::

    async with Router(prefill_addresses, decode_addresses) as router:        # in-process
        completion = await router.generate(Request(messages, tenant="acme", max_new_tokens=16))
        completion = await router.generate(token_ids=[...], tenant="acme")   # same fields
    async with ServingClient("127.0.0.1:8701") as client:    # remote (gRPC), router_service.py
        async for event in client.stream(messages=messages): ...            # GenerateEvent

Admission (``admission.py``): at most ``max_running_requests`` requests are dispatched to
the workers at once; the others wait in a bounded FIFO queue here, and a request that would
wait too long, or did, is refused with ``QueueFull`` (HTTP 429 and ``Retry-After``) rather
than left to pass its deadline. :meth:`Router.refusal` says what a request arriving now would
get, which is also what the HTTP front's ``/health`` answers.

Failure handling, with a deadline on every RPC: a prefill attempt that fails with
UNAVAILABLE (the worker died, is unreachable or is draining) marks that worker down and is
retried on another one; prefill is idempotent (blocks are content addressed), so a retry is
safe. A stream that stays silent (``prefill_attempt_timeout_s``, ``token_timeout_s``) makes
the router ask the worker's Health: a worker that answers is busy, not dead (it computes in a
thread while its event loop answers), and is waited for up to the request's deadline; one
that does not answer is hung and given up on. A decode stream that breaks mid-request is restarted
on another decode worker from the same handoff; decoding is deterministic (greedy or
seeded), so the tokens already streamed are checked and skipped. A draining decode worker
hands its requests back as ``migrate`` events (their KV in the store, the tail inline), and
the router continues each on another decode worker. With no healthy worker left, the
request fails with ``Unavailable`` naming the workers tried. A background probe of every
worker brings one back once its Health answers again, and takes out one whose Health says
it is wedged (``not_serving``: its engine held with no progress past a request's deadline).

Stop strings are matched here, on the text the workers stream (``request.StopMatcher``):
the decode stream is cancelled at the first one and the text ends before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S, AdmissionConfig, AdmissionQueue
from engine_adapter.serving.balancer import (
    POLICIES,
    BalancerConfig,
    PrefillBalancer,
    PrefillSample,
)
from engine_adapter.serving.errors import ContextTooLong
from engine_adapter.serving.metrics import RouterMetrics
from engine_adapter.serving.request import Request, StopMatcher, chat_prompt_ids
from engine_adapter.serving.request_api import RequestAPI
from engine_adapter.serving.router_workers import PROBE_INTERVAL_S, RouterWorkers
from engine_adapter.serving.worker_endpoint import (
    WorkerEndpoint,
    WorkerFault,
    WorkerSet,
    read_events,
)
from engine_adapter.tokenizer import ChatTokenizer
from kvstore.errors import DeadlineExceeded, InvalidArgument, KVStoreError, Unavailable

__all__ = ["POLICIES", "Router"]

log = logging.getLogger(__name__)

PREFILL_ATTEMPT_TIMEOUT_S = 60.0  # silence on a prefill stream before its worker is asked Health
TOKEN_TIMEOUT_S = 15.0  # silence on a decode stream before its worker is asked Health
CHARS_PER_TOKEN_ESTIMATE = 4  # length of a conversation the router cannot tokenize


@dataclass
class _Flight:
    """One request inside the router: what it is, and when its tokens came."""

    request: Request
    proto: pb.GenerateRequest
    arrived_s: float
    deadline_s: float
    num_prompt_tokens: int
    last_token_s: float = 0.0
    num_migrations: int = 0


@dataclass
class _Attempt:
    """One prefill attempt: its worker, and what it measured of the worker (the balancer's)."""

    worker: WorkerEndpoint
    sample: PrefillSample | None = None


class Router(RequestAPI):
    """Routes requests over prefill and decode worker processes (see the module doc)."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        *,
        policy: str = "balanced",
        balancer: BalancerConfig | None = None,
        tokenizer: ChatTokenizer | None = None,
        metrics: RouterMetrics | None = None,
        admission: AdmissionConfig | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prefill_attempt_timeout_s: float = PREFILL_ATTEMPT_TIMEOUT_S,
        token_timeout_s: float = TOKEN_TIMEOUT_S,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``tokenizer`` lets the router apply the chat template itself (then it knows every
        prompt's length, for the balancer and the length check); ``admission`` bounds the
        requests dispatched at once and those queued (default: no limits); ``credentials``
        (TLS) secure the channels to the workers."""
        if not prefill_addresses or not decode_addresses:
            raise InvalidArgument("a router needs at least one prefill and one decode worker")
        if policy not in POLICIES:
            raise InvalidArgument(f"routing policy {policy!r}: choose one of {POLICIES}")
        self.policy = policy
        self.workers = RouterWorkers(prefill_addresses, decode_addresses, credentials, policy)
        self.prefill, self.decode = self.workers.prefill, self.workers.decode
        self.balancer = PrefillBalancer(balancer)
        self.tokenizer = tokenizer
        self.metrics = metrics or RouterMetrics()
        self.admission = AdmissionQueue(admission)
        self.num_waiting = self.num_running = 0
        self.timeout_s = timeout_s
        self.prefill_attempt_timeout_s = prefill_attempt_timeout_s
        self.token_timeout_s = token_timeout_s
        self._prefill_room = asyncio.Event()  # set: a prefill worker's queue got shorter

    @property
    def endpoints(self) -> list[WorkerEndpoint]:
        return self.workers.endpoints

    @property
    def max_model_len(self) -> int:
        """The smallest ``max_model_len`` any worker reported (0 before ``start``)."""
        return self.workers.max_model_len

    async def start(self, timeout_s: float = 30.0) -> None:
        """Wait until every worker answers Health, then keep probing the ones that fail."""
        await self.workers.wait_healthy(timeout_s)
        for worker in self.prefill.workers:
            health = worker.health
            calibration = [
                PrefillSample(n, 0, t)
                for n, t in zip(health.calibration_tokens, health.calibration_s, strict=True)
            ]
            self.balancer.add_worker(worker.address, calibration)
        self.workers.start_probing()

    async def close(self) -> None:
        await self.workers.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def drain(self, worker_id: str, grace_s: float) -> int:
        """Drain decode worker ``worker_id``: no new requests; after ``grace_s`` its requests
        move to other decode workers with their KV. Returns the requests it held."""
        return await self.workers.drain(worker_id, grace_s)

    async def stream_request(self, proto: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        """Run a request that came as its wire message (the gRPC face): validated into a
        :class:`Request`, whose own message (defaults filled in) the workers then get."""
        request = Request.from_proto(proto)
        async for event in self._run(request, request.to_proto()):
            yield event

    def _events(self, request: Request) -> AsyncIterator[pb.GenerateEvent]:
        """Run a validated request (``generate``, ``stream``, the HTTP front): its wire
        message is built here, once."""
        return self._run(request, request.to_proto())

    async def _run(
        self, request: Request, proto: pb.GenerateRequest
    ) -> AsyncIterator[pb.GenerateEvent]:
        """Run one request through a prefill worker, then a decode worker, streaming events."""
        flight = self._admit(request, proto)
        self._count(waiting=+1)
        waiting = True
        try:
            events = self._prefill_then_decode(flight)
            async with self.admission.slot(flight.deadline_s), contextlib.aclosing(events):
                async for event in events:
                    if waiting and event.WhichOneof("event") == "token":
                        waiting = False  # the first token: the request now runs
                        self._count(waiting=-1, running=+1)
                    yield event
        finally:
            if waiting:
                self._count(waiting=-1)
            else:
                self._count(running=-1)

    async def _prefill_then_decode(self, flight: _Flight) -> AsyncIterator[pb.GenerateEvent]:
        """The request's events from the workers, stop strings matched, timings observed."""
        matcher = StopMatcher(flight.request.stop)
        # aclosing: a request left at its finish or stop ends its worker calls now, not at
        # garbage collection (their counts on the workers go with them).
        async with contextlib.aclosing(self._worker_events(flight)) as events:
            async for event in events:
                kind = event.WhichOneof("event")
                if kind == "token":
                    self._observe_token(flight)
                    event.token.text = matcher.feed(event.token.text)
                    yield event
                    if matcher.stopped:
                        yield self._finish(flight, pb.Finish(finish_reason="stop"), matcher)
                        return
                elif kind == "finish":
                    yield self._finish(flight, event.finish, matcher)
                    return
                else:
                    yield event

    def refusal(self) -> KVStoreError | None:
        """What a request arriving now would get instead of being queued (None: queued).

        ``Unavailable`` while no prefill or no decode worker takes requests; ``QueueFull``
        while the queue is full or the wait for a slot would pass the queue's limit.
        """
        for workers in (self.prefill, self.decode):
            if not workers.candidates(set()):
                role = workers.workers[0].role
                return Unavailable(
                    f"no {role} worker takes requests now ({workers.states()}); retry later"
                )
        return self.admission.refusal()

    def _admit(self, request: Request, proto: pb.GenerateRequest) -> _Flight:
        """Tokenize ``proto`` (when the router can), check the length and the queue; the
        flight."""
        now_s = time.monotonic()
        if request.messages and self.tokenizer is not None:
            proto.token_ids[:] = chat_prompt_ids(self.tokenizer, request.messages)
            del proto.messages[:]
        if proto.token_ids:
            num_prompt_tokens = len(proto.token_ids)
        else:  # the workers tokenize: estimate, for the balancer only
            chars = sum(len(m["content"]) for m in request.messages or ())
            num_prompt_tokens = chars // CHARS_PER_TOKEN_ESTIMATE + 1
        max_model_len = self.max_model_len
        if proto.token_ids and max_model_len:
            total = num_prompt_tokens + request.max_new_tokens - 1
            if total > max_model_len:
                raise ContextTooLong(
                    f"{num_prompt_tokens} prompt tokens + max_tokens {request.max_new_tokens} "
                    f"exceed the model's context of {max_model_len} tokens; shorten the prompt "
                    "or lower max_tokens"
                )
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        deadline_s = now_s + (request.timeout_s or self.timeout_s)
        return _Flight(request, proto, now_s, deadline_s, num_prompt_tokens)

    def _observe_token(self, flight: _Flight) -> None:
        now_s = time.monotonic()
        if flight.last_token_s:
            self.metrics.itl.observe(now_s - flight.last_token_s)
        else:
            self.metrics.ttft.observe(now_s - flight.arrived_s)
        flight.last_token_s = now_s
        self.metrics.generation_tokens.inc()

    def _finish(self, flight: _Flight, finish: pb.Finish, matcher: StopMatcher) -> pb.GenerateEvent:
        """The last event: the text as matched (no stop string), the request's counters."""
        if flight.request.stop:
            matcher.flush()
            finish.text = matcher.text
        finish.num_migrations = flight.num_migrations
        self.metrics.e2e.observe(time.monotonic() - flight.arrived_s)
        self.metrics.success.labels(finish.finish_reason).inc()
        return pb.GenerateEvent(finish=finish)

    def _count(self, waiting: int = 0, running: int = 0) -> None:
        """Requests waiting for their first token and running after it, and their gauges."""
        self.num_waiting += waiting
        self.num_running += running
        self.metrics.waiting.set(self.num_waiting)
        self.metrics.running.set(self.num_running)

    async def _worker_events(self, flight: _Flight) -> AsyncIterator[pb.GenerateEvent]:
        proto = flight.proto
        prefill_request = pb.PrefillRequest(
            request_id=proto.request_id,
            tenant=proto.tenant,
            traffic_class=proto.traffic_class,
            messages=proto.messages,
            token_ids=proto.token_ids,
            sampling=proto.sampling,
            cache_salt=proto.cache_salt,
        )
        handoff = pb.Handoff()
        async with contextlib.aclosing(self._prefill(prefill_request, flight)) as prefill:
            async for event in prefill:
                if isinstance(event, pb.Handoff):
                    handoff = event
                else:
                    yield event
        async with contextlib.aclosing(self._decode(handoff, proto.sampling, flight)) as decode:
            async for event in decode:
                yield event

    async def _prefill(
        self, request: pb.PrefillRequest, flight: _Flight
    ) -> AsyncIterator[pb.GenerateEvent | pb.Handoff]:
        """GenerateEvents for the first token, then the Handoff; retried on worker faults."""
        tried: set[str] = set()
        first_token_ids: list[int] = []  # the first attempt's, which a retry must repeat
        while True:
            async with self._prefill_place(flight, tried) as attempt:
                worker = attempt.worker
                try:
                    events = self._prefill_attempt(attempt, request, flight)
                    async with contextlib.aclosing(events):
                        async for event in events:
                            if isinstance(event, pb.Handoff):
                                yield event
                                return
                            for first in self._first(event, first_token_ids, tried, worker):
                                yield first
                except WorkerFault as exc:
                    _remaining_s(flight.deadline_s, request.request_id)  # its own deadline?
                    worker.mark_down(str(exc))
                    log.warning("request %s: retrying prefill: %s", request.request_id, exc)

    def _first(
        self,
        event: pb.PrefillFirst,
        first_token_ids: list[int],
        tried: set[str],
        worker: WorkerEndpoint,
    ) -> list[pb.GenerateEvent]:
        """The prefill stats and first token of the first attempt; none of a retry's, whose
        first token must agree."""
        if not first_token_ids:
            first_token_ids.append(event.first_token_id)
            event.stats.num_attempts = len(tried)
            self._observe_prefill(event.stats)
            token = pb.TokenDelta(token_id=event.first_token_id, text=event.text)
            return [pb.GenerateEvent(prefill=event.stats), pb.GenerateEvent(token=token)]
        if event.first_token_id != first_token_ids[0]:
            raise Unavailable(
                f"prefill retry on {worker.worker_id} sampled token {event.first_token_id}, the "
                f"first attempt {first_token_ids[0]}; workers disagree (different models or seeds?)"
            )
        return []

    def _observe_prefill(self, stats: pb.PrefillStats) -> None:
        self.metrics.prefilled(
            stats.num_computed_tokens, stats.num_cached_tokens, stats.fetch_bytes, stats.fallback
        )

    async def _pick_prefill(self, flight: _Flight, tried: set[str]) -> WorkerEndpoint:
        """The prefill worker for this attempt, by the router's policy."""
        request_id, num_tokens = flight.proto.request_id, flight.num_prompt_tokens
        if self.policy != "balanced":
            worker = self._pick(self.prefill, tried, request_id)
        else:
            worker = await self._bind_prefill(flight, tried)
        bucket = self.balancer.config.bucket_names()[self.balancer.config.bucket_of(num_tokens)]
        self.metrics.prefill_requests.labels(bucket, worker.worker_id).inc()
        return worker

    async def _bind_prefill(self, flight: _Flight, tried: set[str]) -> WorkerEndpoint:
        """Late binding: wait (in arrival order) until a worker has room in its queue, then
        take the one with room that finishes the request soonest.

        Holding requests here rather than queueing them all on workers at once lets each
        assignment see how far the workers really got, so a wrong prediction costs one
        request, not the whole burst behind it.
        """
        request_id = flight.proto.request_id
        while True:
            candidates = self.prefill.candidates(tried)
            if not candidates:
                return self._pick(self.prefill, tried, request_id)  # raises Unavailable
            with_room = [w for w in candidates if self.balancer.has_room(w.address)]
            if with_room:
                by_address = {w.address: w for w in with_room}
                address = self.balancer.assign(
                    request_id, flight.num_prompt_tokens, time.monotonic(), list(by_address)
                )
                return by_address[address]
            self._prefill_room.clear()  # no await since the check: no wake-up is missed
            wait_s = min(_remaining_s(flight.deadline_s, request_id), PROBE_INTERVAL_S)
            with contextlib.suppress(TimeoutError):  # re-check health now and then
                await asyncio.wait_for(self._prefill_room.wait(), wait_s)

    @contextlib.asynccontextmanager
    async def _prefill_place(self, flight: _Flight, tried: set[str]) -> AsyncIterator[_Attempt]:
        """A prefill worker for one attempt, counted on it (and held in the balancer) until
        the attempt ends, however it ends: the count is taken in the turn the worker is."""
        worker = await self._pick_prefill(flight, tried)
        tried.add(worker.address)
        attempt = _Attempt(worker)
        worker.num_active += 1
        try:
            yield attempt
        finally:
            worker.num_active -= 1
            if self.policy == "balanced":
                request_id, now_s = flight.proto.request_id, time.monotonic()
                self.balancer.finish(worker.address, request_id, now_s, attempt.sample)
                self._prefill_room.set()  # waiters wake in arrival order

    async def _prefill_attempt(
        self, attempt: _Attempt, request: pb.PrefillRequest, flight: _Flight
    ) -> AsyncIterator[pb.PrefillFirst | pb.Handoff]:
        worker, timeout_s = attempt.worker, _remaining_s(flight.deadline_s, request.request_id)
        call = worker.stub.Prefill(request, timeout=timeout_s)
        async for event in read_events(call, worker, self.prefill_attempt_timeout_s):
            event = getattr(event, event.WhichOneof("event"))
            if self.policy == "balanced" and isinstance(event, pb.PrefillFirst):
                stats = event.stats
                self.balancer.update(
                    worker.address, request.request_id, stats.num_computed_tokens,
                    stats.num_cached_tokens,
                )  # fmt: skip
                attempt.sample = self._sample(worker, request.request_id, stats)
            yield event

    def _sample(
        self, worker: WorkerEndpoint, request_id: str, stats: pb.PrefillStats
    ) -> PrefillSample | None:
        """What this prefill occupied the worker for, by the router's account: from when it
        reached the head of the worker's queue until now (None if it was not the head)."""
        if not self.balancer.is_head(worker.address, request_id):
            return None
        seconds = time.monotonic() - self.balancer.head_started_s(worker.address)
        return PrefillSample(stats.num_computed_tokens, stats.num_cached_tokens, seconds)

    async def _decode(
        self, handoff: pb.Handoff, sampling: pb.SamplingParams, flight: _Flight
    ) -> AsyncIterator[pb.GenerateEvent]:
        """Token events then the finish event; restarted on another worker on a fault, and
        continued on another one when a draining worker hands the request back."""
        tried: set[str] = set()
        streamed: list[int] = []  # token ids sent to the caller after the first one
        request_id = handoff.request_id
        while True:
            worker = self._pick(self.decode, tried, request_id)
            tried.add(worker.address)
            position = _num_decoded(handoff)
            request = pb.DecodeRequest(handoff=handoff, sampling=sampling)
            events = self._decode_attempt(worker, request, flight.deadline_s)
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        kind = event.WhichOneof("event")
                        if kind == "finish":
                            yield pb.GenerateEvent(finish=event.finish)
                            return
                        if kind == "migrate":
                            handoff, tried = event.migrate, {worker.address}
                            flight.num_migrations += 1
                            self.metrics.migrations.inc()
                            log.info("request %s: moves off %s", request_id, worker.worker_id)
                            break
                        position = _check_replay(streamed, position, event.token.token_id, worker)
                        if position > len(streamed):
                            streamed.append(event.token.token_id)
                            yield pb.GenerateEvent(token=event.token)
            except WorkerFault as exc:
                _remaining_s(flight.deadline_s, request_id)
                worker.mark_down(str(exc))
                log.warning("request %s: restarting decode: %s", request_id, exc)

    async def _decode_attempt(
        self, worker: WorkerEndpoint, request: pb.DecodeRequest, deadline_s: float
    ) -> AsyncIterator[pb.DecodeEvent]:
        timeout_s = _remaining_s(deadline_s, request.handoff.request_id)
        worker.num_active += 1
        try:
            call = worker.stub.Decode(request, timeout=timeout_s)
            async for event in read_events(call, worker, self.token_timeout_s):
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


def _num_decoded(handoff: pb.Handoff) -> int:
    """Tokens the decode stream already produced before this handoff (0 for a prefill's)."""
    if not handoff.num_prompt_tokens:
        return 0
    return len(handoff.token_ids) - handoff.num_prompt_tokens


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
