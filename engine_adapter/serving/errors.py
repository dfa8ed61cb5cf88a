"""Errors only the serving tier raises, as members of kvstore's one hierarchy.

Each extends the kvstore error whose gRPC status it answers with, so
``kvstore.grpc_errors`` (the one mapping) needs no entry of its own for them; the HTTP front
(``openai_api.py``) gives them their own status codes::

    kvstore.errors.InvalidArgument
      ContextTooLong        a prompt plus the tokens asked for exceed the context (HTTP 413)
    kvstore.errors.CapacityExhausted
      QueueFull             too many requests wait for a prefill worker (HTTP 429)
"""

from __future__ import annotations

from kvstore.errors import CapacityExhausted, InvalidArgument


class ContextTooLong(InvalidArgument):
    """A prompt plus the tokens asked for exceed the model's context (the HTTP front's 413)."""


class QueueFull(CapacityExhausted):
    """Too many requests wait for a prefill worker already (the HTTP front's 429)."""
