"""The ttl package's own errors. Pure: no other package of the project.

Both are misuse, so both are ``ValueError`` subclasses; ``kvstore.errors`` re-exports them as
part of the one error hierarchy and ``kvstore.grpc_errors`` maps them to INVALID_ARGUMENT.
"""

from __future__ import annotations


class TTLError(ValueError):
    """Base class of every error the ttl package raises on purpose."""


class UnknownTrafficClass(TTLError):
    """A traffic class that the cluster's configuration does not define."""


class TraceFormatError(TTLError):
    """A request trace has a malformed record; the message names the file and line."""
