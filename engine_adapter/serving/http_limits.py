"""Limits of the HTTP front against slow and oversized clients.

::

    connect --(over max_connections: 503, closed)
            --headers within header_timeout_s (else 408, closed)
            --Content-Length over max_body_bytes: 413, closed, the body never read
            --body within body_timeout_s of the headers (else 408, closed),
              at most max_body_bytes of it (else 413, closed)
            --the app; between requests uvicorn's keep-alive timeout (keep_alive_s)

A slow client (headers never finished, a body at one byte a second) holds only its socket,
and only until its timeout: it gets no worker, no queue place and no request slot, since
those are taken after the body is read. uvicorn has a keep-alive timeout and a header size
bound (h11's 16 KiB) but no header or body timeout and no refusal at connect, so
:func:`guarded_h11_protocol` adds the connection limit and the header timeout to its h11
protocol, and :class:`BodyLimits` (ASGI) the body's size and time limits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from engine_adapter.serving.errors import error_body

if TYPE_CHECKING:
    from uvicorn.protocols.http.h11_impl import H11Protocol

Count = Callable[[str], None]  # counts a closed connection by reason


@dataclass(frozen=True)
class FrontLimits:
    """Connection and request limits of the HTTP front (``kvstore serve`` flags)."""

    max_connections: int = 1024  # open connections; more are answered 503 and closed
    header_timeout_s: float = 10.0  # from connect (or the previous response) to the headers
    body_timeout_s: float = 30.0  # from the headers to the whole body
    max_body_bytes: int = 2 << 20  # a 2048-token prompt is ~10 KB of JSON; 2 MiB is ample
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this (uvicorn's)

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_body_bytes < 1 or self.keep_alive_s < 1:
            raise ValueError(
                "max_connections, max_body_bytes and keep_alive_s must be positive; got "
                f"{self.max_connections}, {self.max_body_bytes}, {self.keep_alive_s}"
            )
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError(
                "header_timeout_s and body_timeout_s must be positive; got "
                f"{self.header_timeout_s}, {self.body_timeout_s}"
            )


def _raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, OpenAI error body included."""
    body = json.dumps(error_body(message, "invalid_request_error", reason)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


def guarded_h11_protocol(limits: FrontLimits, count: Count) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection limit and a header timeout (module doc)."""
    import h11  # imported when serving, not for ``kvstore serve --help``
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                count("connection_limit")
                message = f"over {limits.max_connections} open connections; retry later"
                retry = "retry-after: 1\r\n"
                self._close_with(_raw_response(503, "connection_limit", message, retry))
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a request's headers are incomplete
                self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(
                    limits.header_timeout_s, self._header_timeout
                )

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            count("header_timeout")
            if self.conn.our_state is h11.IDLE:  # no response in progress: say why
                message = f"request headers not received within {limits.header_timeout_s:g} s"
                self._close_with(_raw_response(408, "header_timeout", message))
            else:
                self.transport.close()

        def _close_with(self, response: bytes) -> None:
            self.transport.write(response)
            self.transport.close()

    return GuardedH11Protocol


class BodyLimits:
    """ASGI middleware: a request body over ``max_body_bytes`` gets 413 (by its
    Content-Length before any of it is read, else once it grows past the limit), one not
    complete within ``body_timeout_s`` of the headers gets 408; both close the connection."""

    def __init__(self, app: Any, limits: FrontLimits, count: Count) -> None:
        self.app, self.limits, self.count = app, limits, count

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limits = self.limits
        declared = _content_length(scope)
        if declared is not None and declared > limits.max_body_bytes:
            return await self._refuse(send, "body_too_large")
        guard = _BodyGuard(receive, limits)
        started = False

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if guard.violation:  # the app's answer to a cut-off body is replaced by ours
                return
            started = True
            await send(message)

        await self.app(scope, guard.receive, guarded_send)
        if guard.violation and not started:
            await self._refuse(send, guard.violation)

    async def _refuse(self, send: Any, reason: str) -> None:
        self.count(reason)
        limits = self.limits
        if reason == "body_too_large":
            status, message = 413, f"request body over {limits.max_body_bytes} bytes"
        else:
            status, message = 408, f"request body not received within {limits.body_timeout_s:g} s"
        body = json.dumps(error_body(message, "invalid_request_error", reason)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyGuard:
    """The app's ``receive``, bounded in bytes and in time until the body is complete; on a
    violation it reports a disconnect (the app stops reading) and notes why."""

    def __init__(self, receive: Any, limits: FrontLimits) -> None:
        self._receive, self.limits = receive, limits
        self._deadline_s = asyncio.get_running_loop().time() + limits.body_timeout_s
        self._num_bytes = 0
        self._complete = False
        self.violation = ""

    async def receive(self) -> dict[str, Any]:
        if self._complete:  # after the body: disconnect notices, unbounded
            return await self._receive()
        if self.violation:
            return {"type": "http.disconnect"}
        try:
            async with asyncio.timeout_at(self._deadline_s):
                message = await self._receive()
        except TimeoutError:
            self.violation = "body_timeout"
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self._num_bytes += len(message.get("body", b""))
            self._complete = not message.get("more_body", False)
            if self._num_bytes > self.limits.max_body_bytes:
                self.violation = "body_too_large"
                return {"type": "http.disconnect"}
        return message


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
