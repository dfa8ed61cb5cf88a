"""The one error hierarchy of kvstore. No grpc here: ``kvstore.grpc_errors`` maps it to status
codes, in one place, for servers and clients alike.

A cache miss is never an error (it is ``None``). Errors are misuse (bad input: every misuse
error is a ``ValueError``), failures the caller must see (a write below quorum, a full disk)
and integrity failures (a shard that fails its checksum)::

    KVStoreError                        kvstore, client, engine_adapter
      InvalidArgument (ValueError)      wrong key size, oversized block, bad buffer, bad config
      PermissionDenied                  wrong token, another tenant's data
      CapacityExhausted                 the node cannot store more bytes
        Overloaded                      the node sheds load: its queue would outlast the deadline
      Unavailable                       a node, or too many nodes, could not be reached
        QuorumError                     a write stored too few shards to be readable
        IndexUnusable                   a node's index is damaged: it rebuilds it
        NotServing                      a node is up but still opening or rebuilding its store
      DeadlineExceeded
        Timeout                         a read's deadline passed before it was decided
      BadReply                          a node answered with a malformed message
    erasure.errors.ErasureError         the codec (the bottom layer raises its own)
      InvalidCodecInput (ValueError)
      CodecError: ShardHeaderError, ChecksumMismatch, MixedVersions, TooFewShards
    ttl.errors.TTLError (ValueError)    traffic classes and traces
      UnknownTrafficClass, TraceFormatError

The serving tier extends ``InvalidArgument`` and ``CapacityExhausted`` with errors of its own
(``engine_adapter/serving/errors.py``); they map to gRPC status codes through these bases.

``ERRORS`` is the tuple of the three roots: every error kvstore raises on purpose.
"""

from __future__ import annotations

from erasure.errors import (
    ChecksumMismatch,
    CodecError,
    ErasureError,
    InvalidCodecInput,
    MixedVersions,
    ShardHeaderError,
    TooFewShards,
)
from ttl.errors import TraceFormatError, TTLError, UnknownTrafficClass

__all__ = [
    "ERRORS",
    "RETRYABLE",
    "BadReply",
    "CapacityExhausted",
    "ChecksumMismatch",
    "CodecError",
    "DeadlineExceeded",
    "ErasureError",
    "IndexUnusable",
    "InvalidArgument",
    "InvalidCodecInput",
    "KVStoreError",
    "MixedVersions",
    "NotServing",
    "Overloaded",
    "PermissionDenied",
    "QuorumError",
    "ShardHeaderError",
    "TTLError",
    "Timeout",
    "TooFewShards",
    "TraceFormatError",
    "Unavailable",
    "UnknownTrafficClass",
]


class KVStoreError(Exception):
    """Base class of every error kvstore's own layers (not erasure or ttl) raise on purpose."""


class InvalidArgument(KVStoreError, ValueError):
    """Malformed or out-of-range input: wrong key size, oversized block, bad buffer."""


class PermissionDenied(KVStoreError):
    """Wrong token, or an operation on another tenant's data."""


class CapacityExhausted(KVStoreError):
    """The node cannot store more bytes, even after evicting expirable data."""


class Overloaded(CapacityExhausted):
    """The node refused the request before doing any of it: the work queued ahead of it would
    not finish within the request's deadline. Retry after a backoff (RESOURCE_EXHAUSTED)."""


class Unavailable(KVStoreError):
    """A node or too many nodes could not be reached."""


class QuorumError(Unavailable):
    """A write stored too few shards to be readable; the message says what it left where."""


class IndexUnusable(Unavailable):
    """A node's index cannot be read (damaged or lost): the node rebuilds it from its segment
    records and serves nothing meanwhile (Health says NOT_SERVING)."""


class NotServing(Unavailable):
    """The node is up but not serving data yet (recovering or rebuilding its index)."""


class DeadlineExceeded(KVStoreError):
    """The operation did not finish within its deadline."""


class Timeout(DeadlineExceeded):
    """A read's deadline passed before it was decided: the block may well exist (a miss is
    ``None``, never this). ``keys``: the keys not decided; ``blocks``: the batch's results,
    None where a key timed out."""

    def __init__(
        self,
        message: str,
        keys: list[bytes] | None = None,
        blocks: list[bytes | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.keys = keys or []
        self.blocks = blocks or []


class BadReply(KVStoreError):
    """A node answered with a message the client cannot use (malformed, wrong length)."""


ERRORS: tuple[type[Exception], ...] = (KVStoreError, ErasureError, TTLError)

# Failures worth retrying with backoff: the node may answer on the next attempt.
RETRYABLE: tuple[type[KVStoreError], ...] = (Unavailable, CapacityExhausted)


MAX_QUOTED_CHARS = 64  # of a client-supplied string quoted in an error message


def quoted(text: str, max_chars: int = MAX_QUOTED_CHARS) -> str:
    """``repr`` of a client-supplied string, cut to ``max_chars`` and its length said: an
    error must not echo a 100,000-character name back (a gRPC client would then see
    RESOURCE_EXHAUSTED instead of the reason)."""
    if len(text) <= max_chars:
        return repr(text)
    return f"{text[:max_chars]!r}... ({len(text)} characters)"
