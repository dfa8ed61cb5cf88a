"""The request log and the periodic stats line of ``kvstore serve``, as ``vllm serve`` prints.

One line per request once its response ended (``--disable-log-requests`` turns them off)::

    request 3f2a9c1e7b40 POST /v1/chat/completions tenant=acme status=200 prompt_tokens=412
        cached_tokens=384 completion_tokens=16 ttft_s=0.214 e2e_s=1.305 finish=stop

and every ``--stats-interval-s`` while anything happens (``--disable-log-stats``)::

    stats: 23 requests in 10 s (20 ok, 3 refused 429), prompt 9.4k tokens (hit ratio 71.3%,
        since start 64.0%), generation 160 tokens, 4 running, 7 queued

:class:`RequestLog` is the ASGI middleware that gives each request its id (also the
router's and the workers' id of it, and the response's ``x-request-id`` header), a
:class:`RequestRecord` the front fills in (``scope["state"]["record"]``) and the log line;
:class:`ServingStats` adds the records up.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger(__name__)

LOGGED_PATH_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/admin/")


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class RequestRecord:
    """What the request log says about one request (the front fills it in as it goes)."""

    request_id: str
    method: str = ""
    path: str = ""
    tenant: str = "-"
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    finish: str = ""
    error: str = ""  # the error code, also of an error sent in-band after a 200
    start_s: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        parts = [
            f"request {self.request_id} {self.method} {self.path} tenant={self.tenant}",
            f"status={self.status}",
        ]
        if self.prompt_tokens:
            parts.append(
                f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
                f"completion_tokens={self.completion_tokens}"
            )
        if self.ttft_s is not None:
            parts.append(f"ttft_s={self.ttft_s:.3f}")
        parts.append(f"e2e_s={self.e2e_s:.3f}")
        if self.finish:
            parts.append(f"finish={self.finish}")
        if self.error:
            parts.append(f"error={self.error}")
        return " ".join(parts)


@dataclass
class ServingStats:
    """Totals since start; the stats line is the difference of two snapshots."""

    num_by_status: Counter[int] = field(default_factory=Counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, record: RequestRecord) -> None:
        self.num_by_status[record.status] += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        self.completion_tokens += record.completion_tokens

    def snapshot(self) -> ServingStats:
        return replace(self, num_by_status=Counter(self.num_by_status))

    def line(self, since: ServingStats, interval_s: float, running: int, queued: int) -> str:
        """The stats line for what happened after ``since``."""
        by_status = self.num_by_status - since.num_by_status
        num = sum(by_status.values())
        prompt = self.prompt_tokens - since.prompt_tokens
        cached = self.cached_tokens - since.cached_tokens
        statuses = ", ".join(f"{n} {_status_word(s)}" for s, n in sorted(by_status.items()))
        return (
            f"stats: {num} requests in {interval_s:.0f} s ({statuses or 'none'}), prompt "
            f"{_tokens(prompt)} tokens (hit ratio {_ratio(cached, prompt)}, since start "
            f"{_ratio(self.cached_tokens, self.prompt_tokens)}), generation "
            f"{_tokens(self.completion_tokens - since.completion_tokens)} tokens, "
            f"{running} running, {queued} queued"
        )


def _status_word(status: int) -> str:
    if status == 200:
        return "ok"
    return f"refused {status}" if status in (429, 503) else f"failed {status}"


def _tokens(num: int) -> str:
    return f"{num / 1000:.1f}k" if num >= 10_000 else str(num)


def _ratio(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


class RequestLog:
    """ASGI middleware: request ids, records, the log line and the stats (module doc)."""

    def __init__(self, app: Any, stats: ServingStats, log_requests: bool = True) -> None:
        self.app, self.stats, self.log_requests = app, stats, log_requests

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(LOGGED_PATH_PREFIXES):
            return await self.app(scope, receive, send)
        record = RequestRecord(new_request_id(), scope["method"], scope["path"])
        scope.setdefault("state", {})["record"] = record

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [
                    *message.get("headers", []),
                    (b"x-request-id", record.request_id.encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            record.e2e_s = time.monotonic() - record.start_s
            record.status = record.status or 499  # nginx's "client closed the request"
            self.stats.add(record)
            if self.log_requests:
                log.info("%s", record.line())
