"""The mapping between kvstore's error hierarchy (kvstore/errors.py) and gRPC status codes.

The one place both ends agree on: servers turn an exception into a status with
:func:`to_grpc_status`, clients turn a failed RPC back into an exception with
:func:`from_grpc_status`. The UCX read path carries the same codes in its reply frames.
"""

from __future__ import annotations

import grpc

from kvstore.errors import (
    BadReply,
    CapacityExhausted,
    CodecError,
    DeadlineExceeded,
    InvalidArgument,
    InvalidCodecInput,
    KVStoreError,
    Overloaded,
    PermissionDenied,
    Timeout,
    TTLError,
    Unavailable,
)

# Most specific first: the first class an error is an instance of gives its code.
_ERROR_TO_CODE: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidCodecInput, grpc.StatusCode.INVALID_ARGUMENT),
    (TTLError, grpc.StatusCode.INVALID_ARGUMENT),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (CapacityExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),  # Overloaded among them
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Timeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (CodecError, grpc.StatusCode.DATA_LOSS),
    (BadReply, grpc.StatusCode.DATA_LOSS),
)

_CODE_TO_ERROR: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: BadReply,
}

_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# Overloaded and CapacityExhausted share RESOURCE_EXHAUSTED; a shed request's details start so.
OVERLOADED_MARK = "overloaded:"


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status code a server sends for ``exc`` (INTERNAL for unexpected errors)."""
    for error_type, code in _ERROR_TO_CODE:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def to_grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and message a server sends for ``exc``; unexpected errors are INTERNAL
    and name their type."""
    code = status_code(exc)
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, KVStoreError):
        return code, f"{type(exc).__name__}: {exc}"
    return code, str(exc)


def from_grpc_status(code: grpc.StatusCode, details: str | None) -> KVStoreError:
    """The exception a client raises for a failed RPC. RESOURCE_EXHAUSTED is Overloaded when
    the node says it shed the request (:data:`OVERLOADED_MARK`), CapacityExhausted else."""
    error_type = _CODE_TO_ERROR.get(code, KVStoreError)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and OVERLOADED_MARK in (details or ""):
        error_type = Overloaded
    return error_type(f"{code.name}: {details or ''}".rstrip(": "))


def code_from_value(value: int) -> grpc.StatusCode:
    """The status code numbered ``value`` (UNKNOWN for a number gRPC does not define)."""
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
