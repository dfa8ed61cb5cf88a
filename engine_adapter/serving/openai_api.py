"""The OpenAI-compatible HTTP front of the router (FastAPI, served by uvicorn).

::

    POST /v1/chat/completions   messages through the model's chat template; SSE with stream
    POST /v1/completions        prompt as text or token ids; SSE with stream
    GET  /v1/models             the one model served
    POST /tokenize              vLLM's: {"prompt": ...} or {"messages": [...]} -> token ids
    POST /detokenize            vLLM's: {"tokens": [...]} -> {"prompt": text}
    GET  /health                200 while a request would be taken; 503 (and why) otherwise
    GET  /version               {"version": ...}
    GET  /metrics               Prometheus text (metrics.py)
    POST /admin/drain           {"worker": "d0", "grace_s": 60}; the admin key only

An ASGI stack around the FastAPI app, outermost first::

    RequestLog       request id, the request log line, the stats (request_log.py)
    _Authentication  API key -> tenant (/v1/, /tokenize, /detokenize), admin key (/admin/),
                     checked before the body is read
    BodyLimits       413 / 408 for oversized or slow bodies (http_limits.py)
    _Shield          an unexpected failure becomes a 500 body, the connection stays usable
    FastAPI          the routes; a body is validated (openai_protocol.py) before any use

The tenant comes from the API key (``api_keys.py``); ``usage.prompt_tokens_details
.cached_tokens`` is the prompt KV the prefill worker swapped in from the store. Every error
is an OpenAI error body (``{"error": {"message", "type", "param", "code"}}``) with status 400
(bad request; ``param`` names the field), 401 (missing or unknown key), 403 (the serving tier
may not act for the key's tenant, or not the admin key), 404 (unknown model or path), 408
(slow headers or body), 413 (body over the limit, or prompt plus max_tokens over the
context), 429 (queue full, or a wait too long: ``Retry-After`` says when to retry), 503 (no
worker takes requests; ``Retry-After``) or 504 (a running request passed its deadline); an
unexpected failure is logged and answered 500, without a traceback.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_adapter.serving.api_keys import ApiKeys
from engine_adapter.serving.completions import Completions
from engine_adapter.serving.http_limits import BodyLimits, FrontLimits
from engine_adapter.serving.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine_adapter.serving.request_log import RequestLog, ServingStats
from engine_adapter.serving.router import Router
from kvstore.errors import KVStoreError, PermissionDenied

log = logging.getLogger(__name__)

API_KEY_PATHS = ("/v1/", "/tokenize", "/detokenize")
ADMIN_PATHS = ("/admin/",)


def kvstore_version() -> str:
    try:
        return version("kvstore")
    except PackageNotFoundError:
        return "unknown"


def create_app(
    router: Router,
    model_name: str,
    api_keys: ApiKeys | None = None,
    *,
    limits: FrontLimits | None = None,
    stats: ServingStats | None = None,
    log_requests: bool = True,
) -> Any:
    """The HTTP front of ``router``, serving ``model_name`` (an ASGI app; module doc)."""
    api_keys = api_keys or ApiKeys(None)
    app = FastAPI(title="kvstore serve", docs_url=None, redoc_url=None, openapi_url=None)
    completions = Completions(router, model_name)
    _add_error_handlers(app, router)
    _add_ops_routes(app, router)
    _add_api_routes(app, completions)
    _add_tokenizer_routes(app, completions)
    _add_drain_route(app, router)
    count = router.metrics.closed_connections.labels
    guarded = BodyLimits(_Shield(app), limits or FrontLimits(), lambda r: count(r).inc())
    authenticated = _Authentication(guarded, router, api_keys)
    return RequestLog(authenticated, stats or ServingStats(), log_requests)


def _answer(router: Router, exc: ApiError, request: Request | None = None) -> JSONResponse:
    """The error's response, counted by status and noted in the request's log record."""
    router.metrics.errors.labels(str(exc.status)).inc()
    record = getattr(request.state, "record", None) if request is not None else None
    if record is not None:
        record.error = exc.code or exc.error_type
    return exc.response()


def _add_error_handlers(app: FastAPI, router: Router) -> None:
    """Every failure becomes an OpenAI error body (no traceback reaches a client)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _answer(router, exc, request)

    @app.exception_handler(KVStoreError)
    async def kvstore_error(request: Request, exc: KVStoreError) -> JSONResponse:
        return _answer(router, ApiError.of(exc), request)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return _answer(
            router, ApiError(400, message, "invalid_request_error", None, param), request
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _answer(router, ApiError(exc.status_code, str(exc.detail), kind), request)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        error = ApiError(500, "internal error (see the server log)", "internal_error")
        return _answer(router, error, request)


def _validation_message(errors: Any) -> tuple[str, str | None]:
    """``"field.path: what is wrong"`` and the top field's name, of pydantic's first error."""
    first = errors[0] if errors else {}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = str(loc[0]) if loc and not isinstance(loc[0], int) else None
    return f"{where or 'body'}: {message}", param


class _Authentication:
    """ASGI middleware: the API key's tenant (into ``scope["state"]["tenant"]``), or the
    admin key, checked before the body is read, so an unknown caller learns nothing from
    validation errors. Bodies are JSON whatever their declared content type (``curl -d``
    says form-urlencoded)."""

    def __init__(self, app: Any, router: Router, api_keys: ApiKeys) -> None:
        self.app, self.router, self.api_keys = app, router, api_keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(API_KEY_PATHS + ADMIN_PATHS):
            return await self.app(scope, receive, send)
        authorization = _header(scope, b"authorization")
        state = scope.setdefault("state", {})
        try:
            if path.startswith(ADMIN_PATHS):
                self.api_keys.check_admin(authorization)
                state["tenant"] = "-"
            else:
                state["tenant"] = self.api_keys.tenant(authorization)
        except PermissionDenied as exc:
            error = ApiError.of(exc)
            if path.startswith(ADMIN_PATHS):
                error.status, error.error_type, error.code = 403, "permission_error", "admin_key"
            response = _answer(self.router, error)
            if "record" in state:
                state["record"].error = error.code
            return await response(scope, receive, send)
        if "record" in state:
            state["record"].tenant = state["tenant"]
        if scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope["headers"] = [*headers, (b"content-type", b"application/json")]
        await self.app(scope, receive, send)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class _Shield:
    """ASGI middleware: an exception the app raised after its 500 answer went out whole is
    kept here, so uvicorn does not close the keep-alive connection; one raised before any
    answer gets a 500 body; one that cut a response short still closes the connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        started = completed = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started, completed
            started = started or message["type"] == "http.response.start"
            if message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started and not completed:
                raise
            if not started:
                log.exception("%s %s failed", scope.get("method"), scope.get("path"))
                error = ApiError(500, "internal error (see the server log)", "internal_error")
                await error.response()(scope, receive, send)


def _add_ops_routes(app: FastAPI, router: Router) -> None:
    """``/health``, ``/version`` and ``/metrics``, for probes and Prometheus (no API key)."""

    @app.get("/health")
    async def health() -> Response:
        """200 when a request arriving now would be taken; else 503 with what it would get."""
        refusal = router.refusal()
        if refusal is None:
            return JSONResponse({"status": "ok"})
        error = ApiError.of(refusal)
        body = {"status": "unready", "reason": str(error), "code": error.code}
        headers = {"Retry-After": f"{error.retry_after_s or 1:.0f}"}
        return JSONResponse(body, status_code=503, headers=headers)

    @app.get("/version")
    async def kvstore_serve_version() -> dict[str, str]:
        return {"version": kvstore_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_api_routes(app: FastAPI, completions: Completions) -> None:
    """The OpenAI endpoints under ``/v1/``."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [completions.model_card()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await completions.complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        return await completions.complete(body, request, chat=False)


def _add_tokenizer_routes(app: FastAPI, completions: Completions) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize`` (request and response shapes)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await completions.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return completions.detokenize(body)


def _add_drain_route(app: FastAPI, router: Router) -> None:
    @app.post("/admin/drain")
    async def drain(request: Request) -> dict[str, Any]:
        """Drain a decode worker (the admin key is checked by the middleware)."""
        try:
            body = await request.json()
            worker, grace_s = str(body["worker"]), float(body.get("grace_s", 60.0))
            if not 0 <= grace_s <= 86_400:
                raise ValueError(grace_s)
        except (ValueError, KeyError, TypeError, AttributeError):
            message = 'expected a JSON body {"worker": "d0", "grace_s": 60} (0 to 86400 s)'
            raise ApiError(400, message, "invalid_request_error") from None
        num_active = await router.drain(worker, grace_s)
        return {"worker": worker, "grace_s": grace_s, "num_active": num_active}
