"""The OpenAI-compatible HTTP front of the router (FastAPI, served by uvicorn).

::

    POST /v1/chat/completions   messages through the model's chat template; SSE with stream
    POST /v1/completions        prompt as text or token ids; SSE with stream
    GET  /v1/models             the one model served
    GET  /health                200 while a prefill and a decode worker are up, else 503
    GET  /metrics               Prometheus text (metrics.py)
    POST /admin/drain           {"worker": "d0", "grace_s": 60}; loopback clients only

The tenant comes from the API key (``api_keys.py``); ``usage.prompt_tokens_details
.cached_tokens`` is the prompt KV the prefill worker swapped in from the store. Every error
is an OpenAI error body (``{"error": {"message", "type", "param", "code"}}``) with status 400
(bad request), 401 (missing or unknown key), 404 (unknown model or path), 413 (prompt plus
max_tokens over the context), 429 (queue full), 503 (no worker) or 504 (deadline); an
unexpected failure is logged and answered 500 without a traceback.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from ipaddress import ip_address
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.api_keys import ApiKeys
from engine_adapter.serving.errors import ContextTooLong, QueueFull
from engine_adapter.serving.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
)
from engine_adapter.serving.request import Request as ServingRequest
from engine_adapter.serving.request import chat_prompt_ids
from engine_adapter.serving.router import Router
from kvstore.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unavailable,
)

log = logging.getLogger(__name__)

# kvstore error -> (HTTP status, OpenAI error type, code); the first match wins.
_ERROR_STATUS: list[tuple[type[KVStoreError], int, str, str | None]] = [
    (ContextTooLong, 413, "invalid_request_error", "context_length_exceeded"),
    (QueueFull, 429, "rate_limit_error", "queue_full"),
    (PermissionDenied, 401, "authentication_error", "invalid_api_key"),
    (InvalidArgument, 400, "invalid_request_error", None),
    (DeadlineExceeded, 504, "timeout_error", "deadline_exceeded"),
    (Unavailable, 503, "service_unavailable_error", "no_worker"),
]


class ApiError(Exception):
    """An error answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, error_type: str, code: str | None = None,
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.error_type, self.code, self.param = status, error_type, code, param

    @classmethod
    def of(cls, exc: KVStoreError) -> ApiError:
        for error_type, status, kind, code in _ERROR_STATUS:
            if isinstance(exc, error_type):
                return cls(status, str(exc), kind, code)
        return cls(500, str(exc), "internal_error")

    def response(self) -> JSONResponse:
        body = error_body(str(self), self.error_type, self.code, self.param)
        return JSONResponse(body, status_code=self.status)


def create_app(router: Router, model_name: str, api_keys: ApiKeys | None = None) -> FastAPI:
    """The HTTP front of ``router``, serving ``model_name``."""
    api_keys = api_keys or ApiKeys(None)
    app = FastAPI(title="kvstore serve", docs_url=None, redoc_url=None, openapi_url=None)
    front = _Front(router, model_name, api_keys)
    _add_error_handlers(app, router)
    _add_authentication(app, router, api_keys)
    _add_ops_routes(app, router)
    _add_api_routes(app, front)
    _add_drain_route(app, router)
    return app


def _answer(router: Router, exc: ApiError) -> JSONResponse:
    """The error's response, counted by status."""
    router.metrics.errors.labels(str(exc.status)).inc()
    return exc.response()


def _add_error_handlers(app: FastAPI, router: Router) -> None:
    """Every failure becomes an OpenAI error body (no traceback reaches a client)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _answer(router, exc)

    @app.exception_handler(KVStoreError)
    async def kvstore_error(request: Request, exc: KVStoreError) -> JSONResponse:
        return _answer(router, ApiError.of(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return _answer(router, ApiError(400, message, "invalid_request_error", None, where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _answer(router, ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _answer(
            router, ApiError(500, "internal error (see the server log)", "internal_error")
        )


def _add_authentication(app: FastAPI, router: Router, api_keys: ApiKeys) -> None:
    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        """The key is checked before the body is read: an unknown caller learns nothing
        from validation errors. Bodies are JSON whatever their declared content type
        (``curl -d`` says form-urlencoded)."""
        if request.url.path.startswith("/v1/"):
            try:
                request.state.tenant = api_keys.tenant(request.headers.get("authorization"))
            except PermissionDenied as exc:
                return _answer(router, ApiError.of(exc))
            if request.method == "POST":
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                request.scope["headers"] = [*headers, (b"content-type", b"application/json")]
        return await call_next(request)


def _add_ops_routes(app: FastAPI, router: Router) -> None:
    """``/health`` and ``/metrics``, for probes and Prometheus (no API key)."""

    @app.get("/health")
    async def health() -> Response:
        up = router.prefill.candidates(set()) and router.decode.candidates(set())
        return JSONResponse(
            {"status": "ok" if up else "no workers"}, status_code=200 if up else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_api_routes(app: FastAPI, front: _Front) -> None:
    """The OpenAI endpoints under ``/v1/``."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [front.model_card()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await front.complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await front.complete(body, request, chat=False)


def _add_drain_route(app: FastAPI, router: Router) -> None:
    @app.post("/admin/drain")
    async def drain(request: Request) -> dict[str, Any]:
        client = request.client.host if request.client else ""
        if not client or not ip_address(client).is_loopback:
            raise ApiError(403, "drain is accepted from loopback clients only", "permission_error")
        try:
            body = await request.json()
            worker, grace_s = str(body["worker"]), float(body.get("grace_s", 60.0))
        except (ValueError, KeyError, TypeError, AttributeError):
            message = 'expected a JSON body {"worker": "d0", "grace_s": 60}'
            raise ApiError(400, message, "invalid_request_error") from None
        num_active = await router.drain(worker, grace_s)
        return {"worker": worker, "grace_s": grace_s, "num_active": num_active}


class _Front:
    """Turns OpenAI request bodies into router requests and router events into responses."""

    def __init__(self, router: Router, model_name: str, api_keys: ApiKeys) -> None:
        self.router, self.model_name, self.api_keys = router, model_name, api_keys
        self.created_s = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created_s,
            "owned_by": "kvstore",
            "max_model_len": self.router.max_model_len,
        }

    async def complete(self, body: SamplingFields, http: Request, chat: bool) -> Response:
        tenant = http.state.tenant  # set by the authenticate middleware
        if body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                           f"`{self.model_name}` (GET /v1/models)", "not_found_error",
                           "model_not_found", "model")  # fmt: skip
        request = self._request(body, tenant, chat)
        events = self.router.stream(request)
        try:
            first = await anext(events)  # admission errors (413, 429, 400) come here
        except StopAsyncIteration:
            raise ApiError(
                503, "the router ended the request without an answer", "internal_error"
            ) from None
        kind = "chat.completion" if chat else "text_completion"
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{request.request_id}"
        if body.stream:
            chunks = self._stream(response_id, kind, first, events, body.include_usage(), chat)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return JSONResponse(await self._whole(response_id, kind, first, events, chat))

    def _request(self, body: SamplingFields, tenant: str, chat: bool) -> ServingRequest:
        """The router request of an OpenAI body (400 for what we do not serve)."""
        if body.logprobs:
            raise ApiError(
                400, "logprobs are not supported", "invalid_request_error", None, "logprobs"
            )
        token_ids = self._prompt_ids(body, chat)
        max_tokens = body.requested_max_tokens() if chat else body.max_tokens  # type: ignore[attr-defined]
        if max_tokens is None:
            room = self.router.max_model_len - len(token_ids) + 1
            max_tokens = max(room, 1) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        return ServingRequest(
            token_ids=token_ids,
            tenant=tenant,
            traffic_class=body.traffic_class,
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=secrets.randbits(63) if body.seed is None else body.seed,
            stop=body.stop_strings(),
            cache_salt=body.cache_salt or "",
        )

    def _prompt_ids(self, body: SamplingFields, chat: bool) -> list[int]:
        """Prompt token ids: chat messages through the template, text as untrusted text."""
        tokenizer = self.router.tokenizer
        if chat:
            assert isinstance(body, ChatCompletionRequest)
            if body.tools:
                raise ApiError(
                    400, "tools are not supported", "invalid_request_error", None, "tools"
                )
            if tokenizer is None:
                message = f"model {self.model_name} has no chat template: send token ids"
                raise ApiError(400, message, "invalid_request_error")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return chat_prompt_ids(tokenizer, messages)
        assert isinstance(body, CompletionRequest)
        if body.echo:
            raise ApiError(400, "echo is not supported", "invalid_request_error", None, "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "send one prompt per request (batches are not served)",
                               "invalid_request_error", None, "prompt")  # fmt: skip
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ApiError(400, f"model {self.model_name} has no tokenizer; send the prompt "
                               "as token ids", "invalid_request_error", None, "prompt")  # fmt: skip
            return tokenizer.encode(prompt)
        return list(prompt)

    async def _whole(
        self,
        response_id: str,
        kind: str,
        first: pb.GenerateEvent,
        events: AsyncIterator[pb.GenerateEvent],
        chat: bool,
    ) -> dict[str, Any]:
        stats, finish, num_tokens = pb.PrefillStats(), pb.Finish(), 0
        async for event in _chain(first, events):
            which = event.WhichOneof("event")
            if which == "prefill":
                stats = event.prefill
            elif which == "token":
                num_tokens += 1
            else:
                finish = event.finish
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish.finish_reason,
            "logprobs": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": finish.text}
        else:
            choice["text"] = finish.text
        return {**self._envelope(response_id, kind), "choices": [choice],
                "usage": _usage(stats, num_tokens)}  # fmt: skip

    async def _stream(
        self,
        response_id: str,
        kind: str,
        first: pb.GenerateEvent,
        events: AsyncIterator[pb.GenerateEvent],
        include_usage: bool,
        chat: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per text delta, the finish chunk, usage, ``[DONE]``."""
        kind = f"{kind}.chunk" if chat else kind
        envelope = self._envelope(response_id, kind)
        stats, num_tokens, shown = pb.PrefillStats(), 0, ""

        def chunk(delta: str | None, finish_reason: str | None = None, role: bool = False) -> str:
            return _sse({**envelope, "choices": [_chunk_choice(chat, delta, finish_reason, role)]})

        try:
            if chat:
                yield chunk(None, role=True)
            async for event in _chain(first, events):
                which = event.WhichOneof("event")
                if which == "prefill":
                    stats = event.prefill
                elif which == "token":
                    num_tokens += 1
                    if event.token.text:
                        shown += event.token.text
                        yield chunk(event.token.text)
                else:
                    rest = _unshown(event.finish.text, shown)
                    if rest:
                        yield chunk(rest)
                    yield chunk(None, event.finish.finish_reason)
            if include_usage:
                yield _sse({**envelope, "choices": [], "usage": _usage(stats, num_tokens)})
        except KVStoreError as exc:  # after the first byte the status is sent: say it in-band
            error = ApiError.of(exc)
            self.router.metrics.errors.labels(str(error.status)).inc()
            yield _sse(error_body(str(error), error.error_type, error.code))
        yield "data: [DONE]\n\n"

    def _envelope(self, response_id: str, kind: str) -> dict[str, Any]:
        return {"id": response_id, "object": kind, "created": int(time.time()),
                "model": self.model_name}  # fmt: skip


async def _chain(
    first: pb.GenerateEvent, events: AsyncIterator[pb.GenerateEvent]
) -> AsyncIterator[pb.GenerateEvent]:
    yield first
    async for event in events:
        yield event


def _chunk_choice(
    chat: bool, delta: str | None, finish_reason: str | None, role: bool
) -> dict[str, Any]:
    """The one choice of a stream chunk: a chat ``delta`` (the role first) or ``text``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""} if role else (
            {} if delta is None else {"content": delta})  # fmt: skip
    else:
        choice["text"] = delta or ""
    return choice


def _unshown(text: str, shown: str) -> str:
    """What the final ``text`` adds to the deltas already streamed (``shown``)."""
    return text[len(shown) :] if text.startswith(shown) else ""


def _usage(stats: pb.PrefillStats, num_completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": stats.num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.num_cached_tokens},
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
