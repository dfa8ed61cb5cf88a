"""One request type for the serving tier, its tokenizing, and stop-string matching.

``Request`` is what a caller of :class:`~engine_adapter.serving.router.Router` (in-process,
``ServingClient`` over gRPC, or the HTTP front) asks for; it validates itself and becomes a
``GenerateRequest`` on the wire. :func:`chat_prompt_ids` is the one place a conversation
becomes prompt token ids. :class:`StopMatcher` cuts generated text before the first stop
string, holding back text that may still become one, so a stream never shows it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.tokenizer import ChatTokenizer
from kvstore.errors import InvalidArgument

Message = Mapping[str, str]
MAX_STOP_STRINGS = 4  # as OpenAI's API


def _new_request_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Request:
    """A conversation (``messages``, through the chat template) or a prompt's ``token_ids``.

    ``temperature`` 0 is greedy; otherwise sampling is seeded (same seed, same tokens), over
    the ``top_k`` most likely tokens (0: all) and the smallest set of mass ``top_p``.
    ``cache_salt`` narrows the tenant's block-key salt: requests share cached KV only when
    tenant and salt are both equal. ``timeout_s`` 0 takes the router's default.
    """

    messages: Sequence[Message] | None = None
    token_ids: Sequence[int] | None = None
    tenant: str = "default"
    traffic_class: str = "chat"
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop: Sequence[str] = ()
    cache_salt: str = ""
    timeout_s: float = 0.0
    request_id: str = field(default_factory=_new_request_id)

    def __post_init__(self) -> None:
        if not self.request_id:  # one id for the router, its logs and the workers alike
            object.__setattr__(self, "request_id", _new_request_id())
        if bool(self.messages) == bool(self.token_ids):
            raise InvalidArgument(
                "a request needs either a non-empty conversation messages=[{'role': ..., "
                "'content': ...}] or non-empty prompt token_ids, not both"
            )
        if not self.tenant or not self.traffic_class:
            raise InvalidArgument("a request needs a tenant and a traffic class, e.g. acme / chat")
        if "\0" in self.tenant or "\0" in self.cache_salt:
            raise InvalidArgument("tenant and cache_salt may not contain NUL characters")
        if self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0:
            raise InvalidArgument(
                "need max_new_tokens >= 1, temperature >= 0 and top_k >= 0; got "
                f"{self.max_new_tokens}, {self.temperature}, {self.top_k}"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop) > MAX_STOP_STRINGS or not all(self.stop):
            raise InvalidArgument(
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)}"
            )

    def to_proto(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=self.request_id,
            tenant=self.tenant,
            traffic_class=self.traffic_class,
            messages=[
                pb.ChatMessage(role=m["role"], content=m["content"]) for m in self.messages or ()
            ],
            token_ids=list(self.token_ids or ()),
            sampling=pb.SamplingParams(
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
                ignore_eos=self.ignore_eos,
            ),
            timeout_s=self.timeout_s,
            stop=list(self.stop),
            cache_salt=self.cache_salt,
        )

    @classmethod
    def from_proto(cls, request: pb.GenerateRequest) -> Request:
        """The request a ``GenerateRequest`` describes (validated; empty id: a new one)."""
        sampling = request.sampling
        return cls(
            messages=[{"role": m.role, "content": m.content} for m in request.messages] or None,
            token_ids=list(request.token_ids) or None,
            tenant=request.tenant,
            traffic_class=request.traffic_class,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p or 1.0,
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            stop=tuple(request.stop),
            cache_salt=request.cache_salt,
            timeout_s=request.timeout_s,
            request_id=request.request_id,
        )


def chat_prompt_ids(tokenizer: ChatTokenizer, messages: Iterable[Message]) -> list[int]:
    """Prompt token ids of a conversation, through the model's chat template.

    Whichever tier tokenizes a chat request calls this, so all three give the same ids: the
    HTTP front (it needs the prompt's length for OpenAI's default ``max_tokens``), the router
    (when it has the tokenizer: it then knows every prompt's length) and a prefill worker
    (when the router has none). What each does without a tokenizer is its own: the front and
    a worker refuse the request, the router leaves it to the worker.
    """
    return tokenizer.apply_chat_template(list(messages))


class StopMatcher:
    """Feed text deltas; get back what may be shown, and whether a stop string was hit.

    Text that could be the beginning of a stop string is held back until the next delta
    decides it, so neither a stream nor the final text ever contains a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""  # everything shown so far
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (and of held-back text) that can be shown now."""
        if self.stopped:
            return ""
        pending = self._pending + delta
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._pending = True, ""
            return self._show(pending[: min(hits)])
        held = max((_overlap(pending, s) for s in self.stops), default=0)
        self._pending = pending[len(pending) - held :] if held else ""
        return self._show(pending[: len(pending) - held])

    def flush(self) -> str:
        """At the end of generation: the held-back text was no stop string after all."""
        rest, self._pending = self._pending, ""
        return self._show(rest)

    def _show(self, text: str) -> str:
        self.text += text
        return text


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
