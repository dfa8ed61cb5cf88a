"""What a caller of the router gets: ``generate`` (a :class:`Completion`) and ``stream`` (the
events), shared by the in-process :class:`~engine_adapter.serving.router.Router` and the
remote :class:`~engine_adapter.serving.router_service.ServingClient`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.request import Request
from kvstore.errors import Unavailable


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
    num_migrations: int = 0  # times a draining decode worker handed the request on


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
        num_migrations=finish.num_migrations,
    )


class RequestAPI:
    """``generate`` and ``stream``, shared by the in-process :class:`Router` and the remote
    :class:`ServingClient`; subclasses implement ``stream_request``."""

    def stream_request(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        raise NotImplementedError

    def _events(self, request: Request) -> AsyncIterator[pb.GenerateEvent]:
        """Events of a validated request; here its wire message goes to ``stream_request``
        (the :class:`Router` runs the request itself, from the message it builds once)."""
        return self.stream_request(request.to_proto())

    async def generate(self, request: Request | None = None, /, **fields: Any) -> Completion:
        """Run one request to completion: a :class:`Request`, or its fields as keywords."""
        request = request or Request(**fields)
        return await collect(request.request_id, self._events(request))

    def stream(
        self, request: Request | None = None, /, **fields: Any
    ) -> AsyncIterator[pb.GenerateEvent]:
        """Events of one request: ``prefill`` stats, a ``token`` per token, then ``finish``."""
        return self._events(request or Request(**fields))
