"""The one error hierarchy of kvstore, and its mapping to gRPC status codes.

A cache miss is never an error (it is ``None``). Errors are misuse (bad input), failures the
caller must see (a write below quorum, a full disk) and integrity failures (a shard that fails
its checksum). Servers raise these; :func:`to_grpc_status` turns them into a status code and
the client turns a status back with :func:`from_grpc_status`, so both ends agree in one place.
"""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""

    status_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KVStoreError, ValueError):
    """Malformed or out-of-range input: wrong key size, oversized block, bad buffer."""

    status_code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownTrafficClass(InvalidArgument):
    """A traffic class that the cluster's configuration does not define."""


class TraceFormatError(InvalidArgument):
    """A request trace has a malformed record; the message names the file and line."""


class PermissionDenied(KVStoreError):
    """Wrong token, or an operation on another tenant's data."""

    status_code = grpc.StatusCode.PERMISSION_DENIED


class CapacityExhausted(KVStoreError):
    """The node cannot store more bytes, even after evicting expirable data."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KVStoreError):
    """A node or too many nodes could not be reached."""

    status_code = grpc.StatusCode.UNAVAILABLE


class QuorumError(Unavailable):
    """A write reached fewer nodes than the write quorum; the block is not stored."""


class DeadlineExceeded(KVStoreError):
    status_code = grpc.StatusCode.DEADLINE_EXCEEDED


class CodecError(KVStoreError):
    """Erasure decoding could not produce the exact block."""

    status_code = grpc.StatusCode.DATA_LOSS


class ShardHeaderError(CodecError):
    """A shard header is malformed or does not match the codec (k, m, backend, version)."""


class ChecksumMismatch(CodecError):
    """A shard or a decoded block failed its checksum: the bytes are corrupt."""


class MixedVersions(CodecError):
    """Shards of different block versions were offered to one decode."""


class TooFewShards(CodecError):
    """Fewer than k valid shards of one version were available."""


_CODE_TO_ERROR: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: CodecError,
}

# Status codes worth retrying with backoff: the node may answer on the next attempt.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def to_grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and message a server sends for ``exc`` (INTERNAL for unexpected errors)."""
    if isinstance(exc, KVStoreError):
        return exc.status_code, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def from_grpc_status(code: grpc.StatusCode, details: str | None) -> KVStoreError:
    """The exception a client raises for a failed RPC."""
    error_type = _CODE_TO_ERROR.get(code, KVStoreError)
    return error_type(f"{code.name}: {details or ''}".rstrip(": "))
