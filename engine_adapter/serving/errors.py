"""Errors only the serving tier raises, as members of kvstore's one hierarchy.

Each extends the kvstore error whose gRPC status it answers with, so
``kvstore.grpc_errors`` (the one mapping) needs no entry of its own for them; the HTTP front
(``openai_api.py``) gives them their own status codes::

    kvstore.errors.InvalidArgument
      ContextTooLong        a prompt plus the tokens asked for exceed the context (HTTP 413)
    kvstore.errors.CapacityExhausted
      QueueFull             the router's queue is full, or a request would wait (or waited)
                            longer than the queue allows (HTTP 429, with Retry-After)
    kvstore.errors.PermissionDenied
      TenantNotAllowed      the serving tier's store credential may not act for the API key's
                            tenant (HTTP 403)

:func:`error_body` is OpenAI's error object, the body of every error the front answers.
"""

from __future__ import annotations

from kvstore.errors import CapacityExhausted, InvalidArgument, PermissionDenied


class ContextTooLong(InvalidArgument):
    """A prompt plus the tokens asked for exceed the model's context (the HTTP front's 413)."""


class QueueFull(CapacityExhausted):
    """The router will not queue this request (the HTTP front's 429).

    ``code`` says why: ``queue_full`` (as many requests wait as the queue holds),
    ``queue_wait`` (at the rate requests finish it would wait longer than the queue allows)
    or ``queue_timeout`` (it waited that long). ``retry_after_s`` is the router's estimate of
    when a retry would be taken (the HTTP ``Retry-After`` header).
    """

    def __init__(self, message: str, code: str = "queue_full", retry_after_s: float = 1.0):
        super().__init__(message)
        self.code, self.retry_after_s = code, retry_after_s


class TenantNotAllowed(PermissionDenied):
    """The store refuses the serving tier's credential for this tenant (the front's 403)."""


def error_body(message: str, error_type: str, code: str | None = None, param: str | None = None):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
